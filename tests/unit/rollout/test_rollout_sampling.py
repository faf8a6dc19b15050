import math

import torch

from flashreinforce.rollout.sampling import (
    CDF_BLOCK,
    counter_uniforms,
    mix32,
    processed_logprobs,
    sample,
    stream_key,
)

M32 = 0xFFFFFFFF
NEG = float("-inf")


def lowbias32(x: int) -> int:
    """Reference: Wellons' lowbias32 in plain Python integers."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    stat = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2).item()


def test_mix32_matches_the_reference_hash_without_int64_overflow():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, M32]
    assert mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]
    assert len({stream_key(s) for s in range(1000)}) == 1000
    assert 0 <= stream_key(2**64 - 1) <= M32


def test_counter_uniforms_depend_only_on_key_and_counter():
    keys = torch.tensor([stream_key(1), stream_key(2), stream_key(1)])
    counters = torch.tensor([5, 5, 6])
    batch = counter_uniforms(keys, counters)
    alone = torch.cat([counter_uniforms(keys[i : i + 1], counters[i : i + 1]) for i in range(3)])
    assert torch.equal(batch, alone)
    assert len(set(batch.tolist())) == 3
    u = counter_uniforms(torch.full((100_000,), stream_key(7)), torch.arange(100_000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002


def test_processed_logprobs_by_hand():
    # probs 0.4, 0.3, 0.2, 0.1
    logits = torch.log(torch.tensor([4.0, 3.0, 2.0, 1.0])).expand(7, 4)
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 2.0])
    top_k = torch.tensor([0, 2, 0, 0, 0, 0, 3])
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.4, 1.0, 1.0, 0.7])
    got = processed_logprobs(logits, temperature, top_k, top_p).exp()
    r2, r3 = math.sqrt(2), math.sqrt(3)
    expected = torch.tensor(
        [
            [0.4, 0.3, 0.2, 0.1],  # untouched
            [4 / 7, 3 / 7, 0, 0],  # top-2
            [4 / 7, 3 / 7, 0, 0],  # top-p 0.5: the mass above token 2 is 0.7 >= 0.5
            [1, 0, 0, 0],  # top-p 0.4: the mass above token 1 is 0.4, not < 0.4
            [2 / (3 + r3 + r2), r3 / (3 + r3 + r2), r2 / (3 + r3 + r2), 1 / (3 + r3 + r2)],  # T=2: sqrt(probs)
            [1, 0, 0, 0],  # greedy: a point mass
            [2 / (2 + r3), r3 / (2 + r3), 0, 0],  # T=2, top-3 leaves (2, r3, r2)/sum; mass above r2 is 0.725 >= 0.7
        ]
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_top_k_keeps_ties_at_the_threshold():
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    got = processed_logprobs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert torch.isfinite(got[0, :3]).all() and got[0, 3] == NEG


def test_sampling_matches_the_processed_distribution_and_never_draws_truncated_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    logprobs = processed_logprobs(logits, torch.tensor([0.8]), torch.tensor([8]), torch.tensor([0.9]))  # (1, 12)
    kept = torch.isfinite(logprobs[0])
    assert 2 <= kept.sum() < 8
    n = 40_000
    draws = sample(logprobs.expand(n, 12), counter_uniforms(torch.full((n,), stream_key(3)), torch.arange(n)))
    counts = torch.bincount(draws, minlength=12).double()
    assert counts[~kept].sum() == 0
    assert chi2_pvalue(counts[kept], n * logprobs[0, kept].double().exp()) > 1e-3


def test_extreme_uniforms_land_on_possible_tokens():
    logprobs = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])).expand(2, 5)
    u = torch.tensor([0.0, (2**32 - 1) / 2**32], dtype=torch.float64)
    assert sample(logprobs, u).tolist() == [1, 3]


def full_cdf_sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Reference: one fp64 cumulative sum over the whole vocabulary."""
    cdf = logprobs.double().exp().cumsum(-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


def test_the_blocked_cdf_draws_what_one_cdf_over_the_vocabulary_draws():
    torch.manual_seed(1)
    V = 3 * CDF_BLOCK + 77  # the last block is padded
    logits = torch.randn(512, V) * 4
    top_k = torch.randint(0, 40, (512,))
    top_p = torch.where(torch.rand(512) < 0.5, 1.0, 0.9)
    logprobs = processed_logprobs(logits, torch.full((512,), 0.7), top_k, top_p)
    u = counter_uniforms(torch.full((512,), stream_key(5)), torch.arange(512))
    drawn = sample(logprobs, u)
    assert torch.equal(drawn, full_cdf_sample(logprobs, u))
    assert torch.isfinite(logprobs.gather(1, drawn[:, None])).all()


def test_a_target_past_the_blocks_own_sum_takes_its_last_possible_token():
    # Only tokens in the first block are possible; u just below 1 puts the target at the very end of its CDF,
    # where the two summation orders may disagree by a rounding error: never a token after the last possible.
    probs = torch.zeros(1, 2 * CDF_BLOCK)
    probs[0, : CDF_BLOCK - 3] = torch.rand(CDF_BLOCK - 3) + 0.1
    logprobs = (probs / probs.sum()).log()
    u = torch.tensor([(2**32 - 1) / 2**32], dtype=torch.float64)
    assert sample(logprobs, u).item() == CDF_BLOCK - 4
