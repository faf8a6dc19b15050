import functools
import math
from types import SimpleNamespace

import pytest
import torch

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models.logprobs import first_marked


class BigramLM(torch.nn.Module):
    """logits[b, t] = table[input_ids[b, t]]: a model whose every distribution is known by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table, dtype=torch.float64))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


def bigram():
    # After token 0: probs (1/4, 1/2, 1/4); after 1: (1/4, 1/4, 1/2); after 2: uniform.
    return BigramLM([[0.0, math.log(2), 0.0], [0.0, 0.0, math.log(2)], [0.0, 0.0, 0.0]])


def test_logprobs_and_entropies_are_aligned_with_the_tokens():
    logprobs, entropies = token_logprobs(bigram(), torch.tensor([[0, 1, 2, 2]]))
    h_quarter_half_quarter = 1.5 * math.log(2)
    torch.testing.assert_close(
        logprobs,
        torch.tensor([[0.0, math.log(0.5), math.log(0.5), math.log(1 / 3)]], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        entropies,
        torch.tensor([[0.0, h_quarter_half_quarter, h_quarter_half_quarter, math.log(3)]], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    assert logprobs.dtype == torch.float64  # an fp64 model keeps fp64


def test_low_precision_logits_are_upcast_to_fp32():
    model = build_model(vocab_size=11, hidden_size=32, num_layers=1, num_heads=2, dtype="bf16", seed=0)
    logprobs, entropies = token_logprobs(model, torch.tensor([[1, 2, 3]]))
    assert logprobs.dtype == entropies.dtype == torch.float32


def test_temperature_divides_the_logits():
    logprobs, _ = token_logprobs(bigram(), torch.tensor([[0, 1]]), temperature=2.0, with_entropy=False)
    # probs after 0 at T=2 are proportional to sqrt(1, 2, 1).
    assert logprobs[0, 1].item() == pytest.approx(math.log(math.sqrt(2) / (2 + math.sqrt(2))), abs=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(bigram(), torch.tensor([[0, 1]]), temperature=0.0)


def test_padding_on_either_side_gives_the_unpadded_values_and_zeros_elsewhere():
    model = build_model(vocab_size=11, hidden_size=32, num_layers=2, num_heads=4, seed=3).double()
    short, long = [4, 7, 1], [2, 9, 9, 5, 3]
    alone = [token_logprobs(model, torch.tensor([row]))[0][0] for row in (short, long)]
    pad = 0
    right = torch.tensor([short + [pad, pad], long])
    right_mask = torch.tensor([[1, 1, 1, 0, 0], [1] * 5])
    lp, ent = token_logprobs(model, right, right_mask)
    torch.testing.assert_close(lp[0, :3], alone[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(lp[1], alone[1], rtol=0, atol=1e-6)
    assert lp[0, 3:].abs().sum() == 0 and ent[0, 3:].abs().sum() == 0
    left = torch.tensor([[pad, pad] + short, long])
    lp, ent = token_logprobs(model, left, right_mask.flip(-1))
    torch.testing.assert_close(lp[0, 2:], alone[0], rtol=0, atol=1e-6)
    assert lp[0, :3].abs().sum() == 0  # padding and the first real token have no log-prob


def test_gradient_flows_through_logprobs_only():
    model = build_model(vocab_size=11, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    logprobs, entropies = token_logprobs(model, torch.tensor([[1, 2, 3, 4]]))
    assert logprobs.requires_grad and not entropies.requires_grad
    logprobs.sum().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_a_temperature_per_row_scores_each_row_at_its_own():
    """A mixture's tasks may sample at different temperatures: row b at temperature[b] is row b alone at it."""
    ids = torch.tensor([[0, 1, 2, 2], [1, 0, 1, 2], [2, 2, 0, 1]])
    temperatures = torch.tensor([0.5, 1.0, 2.0])
    logprobs, entropies = token_logprobs(bigram(), ids, temperature=temperatures)
    for row, temperature in enumerate(temperatures.tolist()):
        alone, alone_entropies = token_logprobs(bigram(), ids[row : row + 1], temperature=temperature)
        torch.testing.assert_close(logprobs[row : row + 1], alone)
        torch.testing.assert_close(entropies[row : row + 1], alone_entropies)
    assert not torch.allclose(logprobs[0], token_logprobs(bigram(), ids[:1])[0][0])  # 0.5 is not 1


@pytest.mark.parametrize(("temperature", "message"), [
    (torch.tensor([1.0, 1.0]), r"temperature of shape \(2,\): give a number or one per row \(3,\)"),
    (torch.tensor([1.0, 0.0, 1.0]), "must be > 0"),
])
def test_a_bad_temperature_per_row_is_refused(temperature, message):
    with pytest.raises(ValueError, match=message):
        token_logprobs(bigram(), torch.zeros(3, 4, dtype=torch.long), temperature=temperature)


@pytest.mark.parametrize("trimmed", [True, False], ids=["logits_to_keep", "model-without-logits_to_keep"])
def test_from_token_skips_the_logits_before_it_and_changes_nothing_after(trimmed):
    torch.manual_seed(0)
    model = build_model(50, 32, 2, 4, 64, seed=0) if trimmed else bigram()
    vocab = 50 if trimmed else 3
    input_ids = torch.randint(0, vocab, (3, 12))
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask[2, 9:] = False  # right padding
    full, full_entropy = token_logprobs(model, input_ids, attention_mask)
    kept_logits = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature token_logprobs reads
    def recording(*args, **kwargs):
        kept_logits.append(forward(*args, **kwargs).logits)
        return SimpleNamespace(logits=kept_logits[-1])

    model.forward = recording
    part, part_entropy = token_logprobs(model, input_ids, attention_mask, from_token=5)
    assert kept_logits[0].shape[1] == (8 if trimmed else 12)  # positions 4..11 predict tokens 5..11
    torch.testing.assert_close(part[:, 5:], full[:, 5:], rtol=0, atol=1e-6)
    torch.testing.assert_close(part_entropy[:, 5:], full_entropy[:, 5:], rtol=0, atol=1e-6)
    assert (part[:, :5] == 0).all() and (part_entropy[:, :5] == 0).all()
    part.sum().backward()  # gradients still flow


def test_first_marked_is_the_first_column_any_row_marks():
    mask = torch.zeros(3, 6, dtype=torch.bool)
    assert first_marked(mask) == 6
    mask[1, 4] = mask[2, 2] = True
    assert first_marked(mask) == 2
