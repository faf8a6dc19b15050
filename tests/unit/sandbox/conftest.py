"""Sandboxes shared by a test module: starting one costs ~40 ms, a call ~3 ms."""

from __future__ import annotations

import shutil

import pytest

from flashreinforce.sandbox import Sandbox, SandboxLimits

SHORT = SandboxLimits(wall_s=0.5, cpu_s=5, memory_mb=256)
"""For the attacks that run until they are stopped: the wall clock stops them, quickly."""


def _start(level: str, limits: SandboxLimits) -> Sandbox:
    if shutil.which(level) is None:
        pytest.skip(f"{level} is not installed (apt-get install {'bubblewrap' if level == 'bwrap' else 'util-linux'})")
    return Sandbox(limits, isolation=level)


@pytest.fixture(scope="module")
def bwrap_sandbox():
    with _start("bwrap", SandboxLimits()) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def short_sandbox():
    with _start("bwrap", SHORT) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def unshare_sandbox():
    with _start("unshare", SandboxLimits()) as sandbox:
        yield sandbox
