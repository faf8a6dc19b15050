"""Plots of a run, drawn from metrics.jsonl alone: no torch, no live run needed.

`plot_run(run_dir)` writes plots/{reward,heldout_accuracy,entropy,acceptance_rate,lag_histogram,
tokens_per_second,mismatch,sequence_kl,rejections}.png; for a mixture of tasks task_reward and
task_heldout_accuracy (one curve per task); for batches of several modalities modality_reward, modality_entropy,
modality_mismatch and modality_rejections (one curve per modality: a modality the policy starts to ignore shows
as its own entropy collapse). A plot whose metric a run never logged is skipped and named in the return value.
"""

from __future__ import annotations

from pathlib import Path

from flashreinforce.metrics.sink import read_metrics

LINE_PLOTS = {
    "reward": (["reward/mean", "reward/accuracy"], "training reward"),
    "heldout_accuracy": (["eval/avg@k"], "held-out accuracy (avg@k, %)"),
    "entropy": (["entropy/mean"], "mean token entropy (nats)"),
    "acceptance_rate": (["loss/acceptance_rate"], "trust-region acceptance rate"),
    "tokens_per_second": (["throughput/tokens_per_second"], "generated tokens / s"),
    "mismatch": (["mismatch/same_weights_abs_mean", "mismatch/same_weights_abs_max", "mismatch/abs_logprob_diff"],
                 "|behavior - recomputed| log-prob (same weights; all tokens)"),
    "sequence_kl": (["mismatch/seq_kl_p50", "mismatch/seq_kl_p90", "mismatch/seq_kl_max"],
                    "sequence Bernoulli KL D_i (p50, p90, max)"),
    "rejections": (["mismatch/gate_rejected_fraction", "loss/mismatch/masked_fraction",
                    "mismatch/route_disagreement"], "rejected rows, masked tokens, differing MoE routes"),
}
LOG_SCALE = frozenset({"mismatch", "sequence_kl"})
"""Plots whose series span orders of magnitude (1e-6 in fp32 next to 1e-1 in bf16)."""


def _figure():
    """A figure of its own on the file-only Agg canvas, without pyplot: no global figure registry, so a plot drawn
    in a worker thread or beside another run's is safe, and nothing to close; importing matplotlib at a run's first
    plot, not at the trainer's import, spares every process that never plots (each rank, each test's subprocess)
    about half a second."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(figure)
    # Fixed margins that fit every plot's labels: tight_layout measured every text twice (once to lay out, once to
    # draw) and was 40% of a run's plotting time.
    figure.subplots_adjust(left=0.13, right=0.98, top=0.91, bottom=0.14)
    return figure, figure.subplots()


def _series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[name]) for row in rows if row.get(name) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir: Path) -> dict[str, str]:
    """Draw every plot the run's metrics allow; returns {plot name: path or reason it was skipped}."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    plots = {**LINE_PLOTS, **_task_plots(rows), **_modality_plots(rows)}
    boundaries = stage_boundaries(rows)
    result = {name: _line_plot(rows, names, title, out / f"{name}.png", log=name in LOG_SCALE, boundaries=boundaries)
              for name, (names, title) in plots.items()}
    result["lag_histogram"] = _lag_histogram(rows, out / "lag_histogram.png")
    return result


def stage_boundaries(rows: list[dict]) -> list[tuple[int, str]]:
    """(step, name) where each stage of a pipeline begins: the first row naming it; [] for a one-stage run."""
    boundaries: list[tuple[int, str]] = []
    for row in rows:
        stage = row.get("stage")
        if stage is not None and (not boundaries or boundaries[-1][1] != stage):
            boundaries.append((row["step"], stage))
    return boundaries


def _task_plots(rows: list[dict]) -> dict[str, tuple[list[str], str]]:
    """A mixture of tasks: one curve per task of its training reward and of its held-out accuracy."""
    keys = {key for row in rows for key in row}
    tasks = sorted({key.split("/")[1] for key in keys if key.startswith("task/") and key.endswith("/reward_mean")})
    if not tasks:
        return {}
    return {"task_reward": ([f"task/{t}/reward_mean" for t in tasks], "training reward per task"),
            "task_heldout_accuracy": ([f"eval/task/{t}/avg@k" for t in tasks], "held-out accuracy per task (%)")}


def _modality_plots(rows: list[dict]) -> dict[str, tuple[list[str], str]]:
    """Batches of several modalities: one curve per modality of reward, entropy, behavior KL and rejections."""
    keys = {key for row in rows for key in row}
    tags = sorted({key.split("/")[1] for key in keys if key.startswith("modality/") and key.endswith("/reward_mean")})
    if not tags:
        return {}
    return {
        "modality_reward": ([f"modality/{m}/reward_mean" for m in tags], "training reward per modality"),
        "modality_entropy": ([f"modality/{m}/entropy_mean" for m in tags], "mean token entropy per modality (nats)"),
        "modality_mismatch": ([f"modality/{m}/mismatch_k3_kl" for m in tags],
                              "behavior-policy KL (k3) per token, per modality"),
        "modality_rejections": ([f"modality/{m}/{what}" for m in tags
                                 for what in ("gate_rejected_fraction", "masked_fraction")],
                                "rows rejected by the gate, tokens masked (IcePop / MISC), per modality"),
    }


def _line_plot(rows: list[dict], names: list[str], title: str, path: Path, *, log: bool,
               boundaries: list[tuple[int, str]]) -> str:
    """One plot of the named series over optimizer steps, a pipeline's stage boundaries marked; its path, or why
    it was skipped."""
    series = {name: _series(rows, name) for name in names}
    if not any(xs for xs, _ in series.values()):
        return f"skipped: no {' or '.join(names)} in metrics.jsonl"
    figure, axis = _figure()
    for name, (xs, ys) in series.items():
        if xs:
            axis.plot(xs, ys, marker="." if len(xs) < 30 else None, label=name)
    for step, stage in boundaries[1:]:  # the first stage's start is the plot's left edge
        axis.axvline(step, color="grey", linestyle="--", linewidth=0.8)
        axis.annotate(stage, (step, 1.0), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                      va="top", ha="right", color="grey")
    axis.set_title(title)
    if log:
        axis.set_yscale("symlog", linthresh=1e-7)  # log scale that still shows an exact 0
        # Short labels: the scale's own read 1.31556x10^-10 at the axis' ends when the values sit within a decade.
        from matplotlib.ticker import FormatStrFormatter, NullFormatter

        axis.yaxis.set_major_formatter(FormatStrFormatter("%.2g"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("optimizer step")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=100)
    return str(path)


def _lag_histogram(rows: list[dict], path: Path) -> str:
    """Trained tokens by policy lag (optimizer steps between sampling and training), summed over the run."""
    counts: dict[int, float] = {}
    prefix = "lag/tokens_at_"
    for row in rows:
        for name, value in row.items():
            if name.startswith(prefix) and value:
                lag = int(name[len(prefix):])
                counts[lag] = counts.get(lag, 0.0) + value
    if not counts:
        return "skipped: no lag/tokens_at_* in metrics.jsonl"
    lags = sorted(counts)
    total = sum(counts.values())
    figure, axis = _figure()
    axis.bar(lags, [counts[lag] / total for lag in lags])
    axis.set_xticks(lags)
    axis.set_title("policy lag of trained tokens")
    axis.set_xlabel("lag (optimizer steps)")
    axis.set_ylabel("fraction of tokens")
    figure.savefig(path, dpi=100)
    return str(path)
