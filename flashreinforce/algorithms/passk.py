"""Evaluation metrics: unbiased pass@k (Chen et al. 2021) and avg@k. Pure Python, no torch.

Both return fractions in [0, 1]; reports multiply by 100. Always log k, temperature, top-p and the token
budget next to the number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), in log space so large n stays exact to ~1e-15.
    pass@1 = c/n, pass@n = 1[c > 0], and it is 1 whenever n - c < k. Average it over problems.
    Example: n 4, c 1, k 2 -> 1 - C(3,2)/C(4,2) = 0.5.
    """
    n, c = num_samples, num_correct
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= num_correct ({c}) <= num_samples ({n}) and 1 <= k ({k}) <= num_samples")
    if n - c < k:
        return 1.0
    # every factor 1 - k/i lies in (0, 1) because i > n - c >= k
    return -math.expm1(math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1)))


def avg_at_k(num_correct: Sequence[int], k: int) -> float:
    """avg@k = mean over problems of c_i / k, with k samples per problem (AIME-style; = pass@1 with n = k)."""
    if k < 1 or not num_correct or any(not 0 <= c <= k for c in num_correct):
        raise ValueError(f"avg@k needs k >= 1 and each problem's correct count in [0, k]; got k={k}, {num_correct}")
    return math.fsum(c / k for c in num_correct) / len(num_correct)
