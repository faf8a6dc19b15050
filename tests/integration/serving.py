"""`flashreinforce serve` in a child process for a test: started, its URL read from its ready line, stopped."""

from __future__ import annotations

import contextlib
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

READY = re.compile(r"^serving .* at (?P<url>http://\S+/v1) ")


@contextlib.contextmanager
def served(path: Path, *options: str, timeout_s: float = 180.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base URL, process) of `flashreinforce serve path --port 0 ...`; SIGTERM at the end, which must stop it
    cleanly (exit 0)."""
    process = subprocess.Popen([sys.executable, "-m", "flashreinforce", "serve", str(path), "--port", "0", *options],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield _ready_url(process, timeout_s), process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, f"serve exited {process.returncode}"


def _ready_url(process: subprocess.Popen, timeout_s: float) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and process.poll() is None:
        if selector.select(timeout=1.0):
            line = process.stdout.readline()
            lines.append(line)
            if (ready := READY.match(line)) is not None:
                return ready["url"]
    raise AssertionError(f"serve never said it was ready (exit {process.poll()}):\n{''.join(lines)[-3000:]}")
