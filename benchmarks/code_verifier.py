"""How many responses per second the `code` verifier scores: honest programs against their unit tests.

    python benchmarks/code_verifier.py [--quick] [--responses N] [--repeats R] [--json FILE]

Three kinds of rows, each with honest solutions that pass every test: MBPP-style assert tests (three per row:
`assert f(x) == literal`, `assert set(f(x)) == set(...)`, `assert math.isclose(...)`, `assert f(x)`, `assert
not f(x)`, `assert abs(f(x) - y) < tol`), HumanEval-style rows (one `check(candidate)` function of several
asserts, called on the entry point) and stdin/stdout rows (three runs of the program per row). Each kind is
scored through the verifier pool, as a run does (`verifier.reward_fn=code`, its defaults), with 1 worker and
with 2; the workers and their sandboxes are warm before the clock starts, all of a measurement's responses are
queued at once, and the median of --repeats measurements is reported. Every response must score 1: a run where
one does not stops with its reason, since a timing of failures means nothing. Measure on a quiet machine (the
load average is printed): the verifier's work is processes and pipes, which other load slows unevenly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

from machine import Machine

from flashreinforce.types import Prompt
from flashreinforce.verifiers.pool import VerifierPool

MBPP = [
    ("def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))",
     ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
      "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set((3, 4))",
      "assert similar_elements((11, 12, 14, 13), (17, 15, 14, 13)) == (13, 14)"]),
    ("import math\ndef is_not_prime(n):\n    return any(n % k == 0 for k in range(2, int(math.sqrt(n)) + 1))",
     ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True", "assert not is_not_prime(37)"]),
    ("import heapq\ndef largest(nums, n):\n    return heapq.nlargest(n, nums)",
     ["assert largest([25, 35, 22, 85, 14, 65, 75, 22, 58], 3) == [85, 75, 65]",
      "assert largest([25, 35, 22, 85, 14, 65, 75, 22, 58], 2) == [85, 75]",
      "assert largest([1], 1) == [1]"]),
    ("def remove_char(s, c):\n    return s.replace(c, '')",
     ['assert remove_char("hello", "l") == "heo"', 'assert remove_char("abcda", "a") == "bcd"',
      'assert remove_char("PHP", "P") == "H"']),
    ("import math\ndef circle_area(r):\n    return math.pi * r * r",
     ["import math\nassert math.isclose(circle_area(10), 314.1592653589793, rel_tol=0.001)",
      "import math\nassert math.isclose(circle_area(5), 78.53981633974483, rel_tol=0.001)",
      "assert abs(circle_area(1) - 3.14159) < 1e-4"]),
    ("from collections import Counter\ndef count_words(text):\n    return Counter(text.split())",
     ['assert count_words("a b a") == {"a": 2, "b": 1}', 'assert count_words("x") == {"x": 1}',
      'assert count_words("") == {}']),
    ("def is_palindrome(s):\n    return s == s[::-1]",
     ['assert is_palindrome("abba")', 'assert not is_palindrome("abc")', 'assert is_palindrome("")']),
    ("def average(xs):\n    return sum(xs) / len(xs)",
     ["assert abs(average([1, 2, 3, 4]) - 2.5) < 1e-9", "assert average([2]) == 2.0",
      "assert abs(average([0.1, 0.2]) - 0.15) < 1e-9"]),
    ("def flatten(xs):\n    out = []\n    for x in xs:\n        out += flatten(x) if isinstance(x, list) else [x]\n"
     "    return out",
     ["assert flatten([[1, [2]], 3]) == [1, 2, 3]", "assert flatten([]) == []",
      "assert flatten([[[['a']]], 'b']) == ['a', 'b']"]),
    ("import re\ndef long_words(text):\n    return re.findall(r'\\b\\w{4,}\\b', text)",
     ["assert long_words('Please move back to stream') == ['Please', 'move', 'back', 'stream']",
      "assert long_words('Jing Eco and Tech') == ['Jing', 'Tech']", "assert long_words('a b c') == []"]),
    ("def min_max(xs):\n    return min(xs), max(xs)",
     ["assert min_max([3, 1, 2]) == (1, 3)", "assert min_max([5]) == (5, 5)", "assert min_max([-1, 1]) == (-1, 1)"]),
    ("def char_set(s):\n    return set(s)",
     ["assert char_set('abca') == {'a', 'b', 'c'}", "assert char_set('') == set()",
      "assert sorted(char_set('zz')) == ['z']"]),
]
"""(solution, assert tests) in MBPP's shape: three tests a row."""

HUMANEVAL = [
    ("def has_close_elements(numbers, threshold):\n"
     "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])",
     "METADATA = {'author': 'bench'}\n\n\ndef check(candidate):\n"
     "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
     "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
     "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"
     "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False\n"
     "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True\n\n\ncheck(has_close_elements)"),
    ("def truncate_number(x):\n    return x % 1.0",
     "def check(candidate):\n    assert candidate(3.5) == 0.5\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
     "    assert abs(candidate(123.456) - 0.456) < 1e-6\n\ncheck(truncate_number)"),
    ("def below_zero(ops):\n    total = 0\n    for op in ops:\n        total += op\n        if total < 0:\n"
     "            return True\n    return False",
     "def check(candidate):\n    assert candidate([]) == False\n    assert candidate([1, 2, -3, 1, 2, -3]) == False\n"
     "    assert candidate([1, 2, -4, 5, 6]) == True\n    assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) == True\n"
     "\ncheck(below_zero)"),
    ("def intersperse(numbers, delimiter):\n    out = []\n    for n in numbers:\n        out += [n, delimiter]\n"
     "    return out[:-1]",
     "def check(candidate):\n    assert candidate([], 7) == []\n"
     "    assert candidate([5, 6, 3, 2], 8) == [5, 8, 6, 8, 3, 8, 2]\n"
     "    assert candidate([2, 2, 2], 2) == [2, 2, 2, 2, 2]\n\ncheck(intersperse)"),
]
"""(solution, check function) in HumanEval's shape: one test a row."""

STDIO = [
    ("a, b = map(int, input().split())\nprint(a + b)", [("1 2\n", "3\n"), ("-1 1\n", "0\n"), ("20 22\n", "42\n")]),
    ("import sys\nwords = sys.stdin.read().split()\nprint(len(words))", [("a b c\n", "3\n"), ("\n", "0\n"),
                                                                          ("x\ny z\n", "3\n")]),
    ("n = int(input())\nfor i in range(1, n + 1):\n    print(i * i)", [("3\n", "1\n4\n9\n"), ("1\n", "1\n"),
                                                                       ("0\n", "")]),
    ("print(input()[::-1])", [("abc\n", "cba\n"), ("a\n", "a\n"), ("racecar\n", "racecar\n")]),
]
"""(program, [(stdin, stdout)]) in the shape of APPS / CodeContests: three tests a row."""


@dataclass(frozen=True)
class Measurement:
    kind: str
    workers: int
    responses: int
    seconds: list[float]

    @property
    def responses_per_second(self) -> float:
        return self.responses / statistics.median(self.seconds)

    @property
    def ms_per_response_per_worker(self) -> float:
        return 1e3 * statistics.median(self.seconds) * self.workers / self.responses


def rows(kind: str) -> list[tuple[str, str]]:
    """(completion, ground truth) of every honest row of a kind."""
    if kind == "mbpp":
        return [(fenced(program), json.dumps(tests)) for program, tests in MBPP]
    if kind == "humaneval":
        return [(fenced(program), json.dumps([check])) for program, check in HUMANEVAL]
    return [(fenced(program), json.dumps([{"input": i, "output": o} for i, o in pairs])) for program, pairs in STDIO]


def fenced(program: str) -> str:
    return f"Here is a solution.\n```python\n{program}\n```\n"


def score_all(pool: VerifierPool, kind: str, count: int) -> float:
    """Queue `count` responses of the kind at once (its rows in turn); seconds until the last verdict."""
    cases = rows(kind)
    prompts = [Prompt(id=f"{kind}/{i}", prompt="", ground_truth=truth) for i, (_, truth) in enumerate(cases)]
    start = time.perf_counter()
    futures = [pool.submit(cases[i % len(cases)][0], prompts[i % len(cases)]) for i in range(count)]
    verdicts = [future.result() for future in futures]
    seconds = time.perf_counter() - start
    failed = [(prompts[i % len(cases)].id, v.reason) for i, v in enumerate(verdicts) if v.reward != 1.0]
    if failed:
        raise SystemExit(f"an honest {kind} response did not score 1: {failed[:3]}; fix the verifier or the row")
    return seconds


def measure(kind: str, workers: int, responses: int, repeats: int) -> Measurement:
    with VerifierPool(["code"], timeout_s=30.0, min_workers=workers, max_workers=workers) as pool:
        score_all(pool, kind, 4 * workers)  # every worker started, its sandbox warm and the ground truths parsed
        return Measurement(kind, workers, responses, [score_all(pool, kind, responses) for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 responses, 1 repeat")
    parser.add_argument("--responses", type=int, default=120, help="responses per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per setting (the median is reported)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args()
    responses, repeats = (16, 1) if args.quick else (args.responses, args.repeats)
    machine = Machine.measure()
    print(machine.describe())
    machine.warn_if_busy()
    print(f"{responses} responses a measurement, median of {repeats}\n")
    print("| rows | workers | responses/s | ms a response, per worker | seconds |\n|---|---|---|---|---|")
    results = []
    for kind in ("mbpp", "humaneval", "stdio"):
        for workers in (1, min(2, os.cpu_count() or 1)):
            result = measure(kind, workers, responses, repeats)
            results.append(result)
            print(f"| {kind} | {workers} | {result.responses_per_second:.1f} | "
                  f"{result.ms_per_response_per_worker:.1f} | {', '.join(f'{s:.2f}' for s in result.seconds)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.as_dict(), "responses": responses, "repeats": repeats,
                       "results": [{**asdict(r), "responses_per_second": r.responses_per_second,
                                    "ms_per_response_per_worker": r.ms_per_response_per_worker} for r in results]},
                      f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
