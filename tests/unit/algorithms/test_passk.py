"""pass@k and avg@k (ALGORITHMS.md section 8)."""

from fractions import Fraction
from itertools import pairwise
from math import comb

import pytest

from flashreinforce.algorithms import avg_at_k, pass_at_k


def exact(n, c, k):
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def test_hand_value():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (5, 2), (10, 0), (10, 10), (16, 3)])
def test_edges(n, c):
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-15)
    assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


def test_one_when_fewer_failures_than_k():
    assert pass_at_k(10, 8, 3) == 1.0


def test_matches_exact_binomial_and_is_non_decreasing_in_k():
    for n in range(1, 21):
        for c in range(n + 1):
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            for k, value in enumerate(values, start=1):
                assert abs(value - exact(n, c, k)) < 1e-12, (n, c, k)
            assert all(a <= b + 1e-15 for a, b in pairwise(values))


def test_large_n_stays_accurate():
    assert abs(pass_at_k(1000, 3, 100) - exact(1000, 3, 100)) < 1e-12


def test_avg_at_k_equals_pass_at_1_with_n_equal_k():
    correct = [0, 3, 8, 5]
    expected = sum(pass_at_k(8, c, 1) for c in correct) / 4
    assert avg_at_k(correct, 8) == pytest.approx(expected, abs=1e-15)
    assert avg_at_k(correct, 8) == pytest.approx(16 / 32)


@pytest.mark.parametrize("n,c,k", [(3, 4, 1), (3, 1, 0), (3, 1, 4), (2, -1, 1)])
def test_bad_counts_raise(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        avg_at_k([4], 3)
