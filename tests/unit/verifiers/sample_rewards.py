"""Reward functions that misbehave on purpose, loaded by reference in the pool tests."""

import ctypes
import os
import sys
import time

from flashreinforce.types import Verdict


def exact(completion, ground_truth, prompt):
    return completion == ground_truth


def scaled(completion, ground_truth, prompt):
    return float(completion)


def verdict(completion, ground_truth, prompt):
    return Verdict(reward=0.5, passed=True, reason="partial")


def returns_none(completion, ground_truth, prompt):
    return None


def raises(completion, ground_truth, prompt):
    raise ZeroDivisionError("no reward for you")


def hangs(completion, ground_truth, prompt):
    while True:
        time.sleep(0.01)


def slow(completion, ground_truth, prompt):
    time.sleep(float(completion))
    return True


def spin(completion, ground_truth, prompt):
    end = time.perf_counter() + float(completion)
    while time.perf_counter() < end:
        pass
    return True


def exits(completion, ground_truth, prompt):
    os._exit(3)


def segfaults(completion, ground_truth, prompt):
    ctypes.string_at(0)


def out_of_memory(completion, ground_truth, prompt):
    raise MemoryError("pretend the heap is gone")


def allocates(completion, ground_truth, prompt):
    return len(bytearray(int(completion) * 2**20)) > 0


def calls_exit(completion, ground_truth, prompt):
    raise SystemExit(4)


def pid(completion, ground_truth, prompt):
    return float(os.getpid())


def environment(completion, ground_truth, prompt):
    # What the worker process inherited: its thread settings and whether the parent's modules came along.
    loaded = ",".join(m for m in ("pytest", "torch", "sympy") if m in sys.modules)
    return Verdict(reward=0.0, passed=True, reason=f"omp={os.environ.get('OMP_NUM_THREADS')} modules={loaded}")


def spawns_child(completion, ground_truth, prompt):
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    return float(child.pid)


not_callable = 3


def two_args(completion, ground_truth):
    return True
