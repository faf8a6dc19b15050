"""Where metrics go: one flat JSONL row per optimizer step, TensorBoard events, and optionally W&B.

Rows are `{"step": int, "time": float, "<namespace>/<name>": float, ...}` (and "stage": str in a pipeline). On resume, rows (and
TensorBoard events) after the checkpoint's step are discarded first, so a killed-and-resumed run's files
read like an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep rows whose "step" is <= last_step (and drop a torn final line left by a kill)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= last_step:
            kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))


def _jsonable(value: float) -> float | None:
    return value if math.isfinite(value) else None


class MetricsSink:
    def __init__(
        self,
        run_dir: Path,
        *,
        tensorboard: bool,
        wandb: bool,
        config: dict[str, Any],
        resume_step: int | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """`tags`: fields every metrics.jsonl row carries (a pipeline's stage name), kept out of TensorBoard/W&B."""
        self.tags = dict(tags or {})
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "samples.jsonl"
        if resume_step is not None:
            truncate_jsonl(self.metrics_path, resume_step)
            truncate_jsonl(self.samples_path, resume_step)
        # Open for the run's life (appended to at every step), closed by close().
        self._metrics = open(self.metrics_path, "a")  # noqa: SIM115
        self._samples = open(self.samples_path, "a")  # noqa: SIM115
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if wandb:
            try:
                import wandb as wandb_module
            except ImportError:
                raise ValueError("log.wandb=true needs the wandb extra: pip install 'flashreinforce[wandb]'") from None
            self._wandb = wandb_module.init(project="flashreinforce", name=config.get("name"), config=config,
                                            dir=str(run_dir), resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": time.time(), **self.tags,
               **{k: _jsonable(float(v)) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tensorboard is not None:
            for name, value in metrics.items():
                if math.isfinite(value):
                    self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def has_evaluation(self, step: int) -> bool:
        """Does metrics.jsonl hold a held-out evaluation's own row at `step` (not one merged into a training
        step's)? A resumed run asks before logging an evaluation it kept, so a row is never written twice."""
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a torn last line: not a row
                continue
            if row.get("step") == step and "eval/avg@k" in row and "loss/policy" not in row:
                return True
        return False

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._samples.write(json.dumps({"step": step, **row}) + "\n")
        self._samples.flush()

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
