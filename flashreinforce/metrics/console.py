"""What the user watches: progress bars on a terminal, plain lines elsewhere (CI logs, redirects)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flashreinforce.types import HACKING_SIGNS

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11; the project supports 3.10


class TrainingProgress:
    """Step, reward, held-out accuracy, lag and tokens/s of the RL loop."""

    def __init__(self, console: Console, total: int, completed: int, live: bool) -> None:
        self.console = console
        self.total = total
        self.live = live
        self._progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
        )
        self._task = self._progress.add_task("RL", total=total, completed=completed, info="")

    def __enter__(self) -> Self:
        if self.live:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self._progress.stop()

    def update(self, version: int, metrics: dict[str, float], heldout: float | None) -> None:
        info = (
            f"reward {metrics.get('reward/mean', float('nan')):.3f}{worst_task(metrics)}  "
            f"held-out {heldout if heldout is not None else float('nan'):.1f}%  "
            f"lag {metrics.get('lag/mean', 0.0):.2f}/{metrics.get('lag/max', 0.0):.0f}  "
            f"{metrics.get('throughput/tokens_per_second', 0.0):,.0f} tok/s{hacking(metrics)}"
        )
        self._progress.update(self._task, completed=version, info=info)
        if not self.live and (version % 10 == 0 or version == self.total):
            self.console.print(f"step {version}/{self.total}  {info}")


def worst_task(metrics: dict[str, float]) -> str:
    """" (worst: tool 0.125)" for a mixture's step, the task of the lowest training reward; "" for one task."""
    rewards = {key.split("/")[1]: value for key, value in metrics.items()
               if key.startswith("task/") and key.endswith("/reward_mean")}
    if len(rewards) < 2:
        return ""
    task = min(rewards, key=rewards.get)
    return f" (worst: {task} {rewards[task]:.3f})"


def hacking(metrics: dict[str, float]) -> str:
    """"  hacking signs 25% (rewarded 0%)" for a step whose rows carry hacking-watch signs (metrics/groups.py);
    "" for one without."""
    if "hacking/any" not in metrics:
        return ""
    return f"  hacking signs {metrics['hacking/any']:.0%} (rewarded {metrics['hacking/rewarded/any']:.0%})"


def watch_summary(verifier: dict[str, float]) -> str | None:
    """"exited_early 12, not_plain 3 of 96 scored" from the verifier pool's counters; None when it saw no sign."""
    seen = {sign: int(verifier[sign]) for sign in HACKING_SIGNS if verifier.get(sign)}
    if not seen:
        return None
    return ", ".join(f"{sign} {count}" for sign, count in seen.items()) + f" of {int(verifier.get('calls', 0))} scored"


def before_after(scores: dict[str, Any]) -> str:
    """"44.3% -> 72.9%" from a summary's initial/final accuracy ("72.9%" where there is no before)."""
    after = f"{scores['final_accuracy']:.1f}%"
    return f"{scores['initial_accuracy']:.1f}% -> {after}" if scores.get("initial_accuracy") is not None else after


def teacher_text(summary: dict[str, Any], task: str) -> str:
    """" (teacher 81.2%)" beside a distilled task's scores; "" without a teacher."""
    teacher = summary.get("teachers", {}).get(task)
    return "" if teacher is None else f" (teacher {teacher['accuracy']:.1f}%)"


class Reporter:
    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console()
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def warn(self, text: str) -> None:
        """Something the user must see whatever log.progress says (a damaged checkpoint skipped, ...)."""
        self.console.print(f"warning: {text}", highlight=False)

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        if self.live:
            with self.console.status(text):
                yield
        else:
            self.note(f"{text} ...")
            yield

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[Callable[[str], None]]:
        """A bar for a counted task; yields advance(info) to call once per unit."""
        progress = Progress(TextColumn(f"[bold]{description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=self.console)
        task = progress.add_task(description, total=total, info="")
        if self.live:
            progress.start()
        try:
            yield lambda info: progress.update(task, advance=1, info=info)
        finally:
            if self.live:
                progress.stop()

    def training(self, total: int, completed: int) -> TrainingProgress:
        return TrainingProgress(self.console, total, completed, live=self.live and self.enabled)

    def stages(self, stages: list[dict[str, Any]]) -> None:
        """A pipeline's stages: steps and held-out before -> after, in total and per task."""
        if not self.enabled:
            return
        table = Table(title="stages")
        for column in ("stage", "kind", "steps", "held-out", "per task"):
            table.add_column(column)
        for stage in stages:
            tasks = stage.get("tasks", {})
            table.add_row(stage["stage"], stage["kind"], f"{stage['first_step']} -> {stage['optimizer_steps']}"
                          if stage["kind"] != "sft" else str(stage["steps"]),
                          before_after(stage), "  ".join(f"{name} {before_after(scores)}{teacher_text(stage, name)}"
                                                         for name, scores in tasks.items()))
        self.console.print(table)

    def summary(self, summary: dict[str, Any], plots: dict[str, str]) -> None:
        if not self.enabled:
            return
        table = Table(title="flashreinforce run summary", show_header=False)
        gain = summary["final_accuracy"] - summary["initial_accuracy"]
        k = summary["eval_k"]
        rows = [
            (f"held-out avg@{k} before RL", f"{summary['initial_accuracy']:.1f}%"),
            (f"held-out avg@{k} after RL", f"{summary['final_accuracy']:.1f}% ({gain:+.1f} points)"),
            ("optimizer steps", str(summary["optimizer_steps"])),
            ("trained trajectories", str(summary["trained_trajectories"])),
            ("dropped trajectories", ", ".join(f"{k}: {v}" for k, v in summary["dropped_trajectories"].items()) or "0"),
            ("wall clock", f"{summary['wall_seconds']:.0f} s"),
            ("run directory", summary["run_dir"]),
        ]
        watch = watch_summary(summary.get("verifier", {}))
        if watch is not None:
            rows.append(("hacking watch (rows)", watch))
        for name, value in rows:
            table.add_row(name, value)
        self.console.print(table)
        skipped = {name: why for name, why in plots.items() if why.startswith("skipped")}
        for name, why in skipped.items():
            self.console.print(f"plot {name}: {why}")
