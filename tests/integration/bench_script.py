"""How the benchmark tests run a script of benchmarks/: as a user does, in a fresh interpreter, with its exit status
checked and the tails of its output in the failure (imported by its siblings, as run_ledger is)."""

import subprocess
import sys
from pathlib import Path


def run_script(script: Path, *args: object, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs `python script args...` and returns it (stdout and stderr as text) once it has exited 0; any other exit
    fails the test showing the tails of both: a benchmark's own checks say what broke on stderr, and the last rows
    it printed (a worker's report, a table) say how far it got."""
    done = subprocess.run([sys.executable, str(script), *map(str, args)], check=False, timeout=timeout,
                          capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, (f"{script.name} exited {done.returncode}\n--- stdout (tail):\n{done.stdout[-1500:]}"
                                  f"\n--- stderr (tail):\n{done.stderr[-3000:]}")
    return done
