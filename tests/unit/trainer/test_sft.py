"""The SFT warm start pads runs of similar length, not the whole batch to its longest row: a mixture of short
answers and long multi-turn traces trains the same loss and gradient in fewer padded cells."""

import pytest
import torch

from flashreinforce.models import build_model
from flashreinforce.trainer.sft import _target_logprob_sum, length_chunks, sft_warm_start

VOCAB = 16


def test_length_chunks_cover_every_row_once_in_runs_of_similar_length():
    lengths = [30, 400, 28, 55, 31, 420, 60, 29]
    chunks = length_chunks(lengths)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(lengths)))
    assert all(max(lengths[i] for i in c) <= 1.5 * min(lengths[i] for i in c) for c in chunks)
    assert [sorted(lengths[i] for i in c) for c in chunks] == [[28, 29, 30, 31], [55, 60], [400, 420]]
    padded = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
    assert padded < 0.4 * len(lengths) * max(lengths)  # one padded batch would hold 8 x 420 cells
    assert length_chunks([]) == [] and length_chunks([5, 5, 5]) == [[0, 1, 2]]


def _examples(generator: torch.Generator) -> list[tuple[list[int], list[int], list[int]]]:
    """Short answers and a few long traces, with a completion mask (forced observation tokens untrained)."""
    examples = []
    for length in (3, 4, 3, 40, 5, 36, 4, 3):
        completion = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
        mask = [int(i % 5 != 4) for i in range(length)]
        examples.append((torch.randint(1, VOCAB, (2,), generator=generator).tolist(), completion, mask))
    return examples


def test_the_chunked_gradient_equals_the_one_padded_forward_gradient():
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=0)
    examples = _examples(torch.Generator().manual_seed(0))
    targets = sum(sum(e[2]) for e in examples)

    def gradient(chunks: list[list[int]]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for chunk in chunks:
            (-_target_logprob_sum(model, [examples[i] for i in chunk], 0) / targets).backward()
        return [p.grad.clone() for p in model.parameters()]

    chunks = length_chunks([len(p) + len(c) for p, c, _ in examples])
    assert len(chunks) > 1
    for whole, chunked in zip(gradient([list(range(len(examples)))]), gradient(chunks)):
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


def test_sft_steps_lower_the_loss_on_a_mixed_length_batch():
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=0)
    examples = _examples(torch.Generator().manual_seed(1))
    losses = sft_warm_start(model, examples, steps=30, batch_size=8, lr=1e-2, seed=0, pad_token_id=0)
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]


def test_sft_without_examples_says_so():
    model = build_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64, seed=0)
    with pytest.raises(ValueError, match="at least one example"):
        sft_warm_start(model, [], steps=1, batch_size=2, lr=1e-3, seed=0, pad_token_id=0)
