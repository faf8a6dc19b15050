"""What every benchmark records next to its numbers: the machine, how busy it was, and the threads used.

    from machine import Machine          # benchmarks/ is the script directory, so this import just works
    machine = Machine.measure()          # at the start, before any work
    print(machine.describe())            # one line: cores, load average, torch threads, versions
    machine.warn_if_busy()               # prints a warning when other work was running
    json.dump({"machine": machine.as_dict(), ...}, ...)
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass

BUSY_LOAD = 0.5
"""A 1-minute load average above this means something else was running: timings are noisy."""


@dataclass(frozen=True)
class Machine:
    cores: int
    load_average: float
    """1-minute load average when the benchmark started."""
    torch_threads: int
    torch: str
    python: str
    processor: str

    @classmethod
    def measure(cls) -> Machine:
        import torch

        return cls(
            cores=os.cpu_count() or 1,
            load_average=os.getloadavg()[0],
            torch_threads=torch.get_num_threads(),
            torch=torch.__version__,
            python=platform.python_version(),
            processor=platform.machine(),
        )

    @property
    def busy(self) -> bool:
        return self.load_average > BUSY_LOAD

    def describe(self) -> str:
        return (f"machine: {self.cores} cores ({self.processor}), load average {self.load_average:.2f} at start, "
                f"torch {self.torch} with {self.torch_threads} threads, python {self.python}")

    def warn_if_busy(self) -> None:
        if self.busy:
            print(f"WARNING: load average {self.load_average:.2f} > {BUSY_LOAD} at start: other work was running "
                  "and the timings are noisy; rerun on an idle machine before quoting them")

    def as_dict(self) -> dict:
        return {**asdict(self), "busy": self.busy}
