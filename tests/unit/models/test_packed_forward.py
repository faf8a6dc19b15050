"""Packed rows (models/packing.py) and the packed forward (models/logprobs.py packed_token_logprobs): every family the
engine serves gives the padded forward's log-probs and entropies, sliding windows and eager attention included."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from flashreinforce.models import build_model, token_logprobs
from flashreinforce.models import logprobs as logprobs_module
from flashreinforce.models.logprobs import first_marked_rows, packed_token_logprobs
from flashreinforce.models.packing import Packing, first_fit_decreasing, packed_masks, packing_problem

sys.path.insert(0, str(Path(__file__).parents[2]))
from model_families import FAMILY_NAMES, WINDOW, tiny_family_model

LENGTHS = [3, 12, 7, 20, 5, 9, 2, 14]
"""Rows longer and shorter than the families' sliding window (WINDOW tokens)."""


def rows(lengths=LENGTHS, vocab=64, seed=0):
    """Right-padded random rows of these lengths: (input_ids, attention_mask), padding id 0."""
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    return ids.masked_fill(~mask, 0), mask


def packing_of(lengths=LENGTHS):
    return Packing.of(first_fit_decreasing(lengths, max(lengths)), lengths, max(lengths))


def test_first_fit_decreasing_places_each_row_once_longest_first():
    assert first_fit_decreasing([2, 5, 3], 5) == [[1], [2, 0]]
    bins = first_fit_decreasing(LENGTHS, 20)
    assert sorted(row for packed in bins for row in packed) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[row] for row in packed) <= 20 for packed in bins)
    assert len(bins) == 4  # 72 tokens in rows of 20: [20], [14, 5], [12, 7], [9, 3, 2] ...
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3, 6], 5)


def test_pack_and_unpack_move_real_tokens_and_restart_positions():
    ids, _ = rows([3, 5, 2])
    packing = Packing.of([[1], [0, 2]], [3, 5, 2], 5)
    packed = packing.pack(ids, fill=-7)
    assert packed.tolist() == [ids[1].tolist(), [*ids[0, :3].tolist(), *ids[2, :2].tolist()]]
    assert packing.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packing.segments.tolist()[1] == [0, 0, 0, 2, 2] and packing.cells == 10
    assert torch.equal(packing.unpack(packed, fill=0), ids)  # padding back as 0, as collate pads
    short = Packing.of([[0, 2]], [3, 5, 2], 5)  # row 1 left out: nothing of it is moved
    assert short.pack(ids, fill=-1).tolist() == [[*ids[0, :3].tolist(), *ids[2, :2].tolist()]]


def test_packed_masks_keep_rows_apart_and_windows_within_rows():
    packing = Packing.of([[0, 1], [2]], [3, 2, 4], 4)
    mask = packed_masks(packing, build_model(11, 16, 1, 2, 16).config)
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                         [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert mask[1, 0, 4].int().tolist() == [0, 0, 0, 0, 1]  # filler attends to itself only: no empty softmax row
    windowed = tiny_family_model("gemma2").config  # local and global layers: one mask per layer type
    masks = packed_masks(Packing.of([[0]], [8], 8), windowed)
    assert masks["sliding_attention"][0, 0, 7].int().tolist() == [0, 0, 0, 1, 1, 1, 1, 1]  # 7 - 5 < k <= 7
    assert masks["full_attention"][0, 0, 7].all()
    additive = packed_masks(packing, build_model(11, 16, 1, 2, 16).config, torch.float32)
    assert additive[0, 0, 3, 0] == torch.finfo(torch.float32).min and additive[0, 0, 3, 3] == 0


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_gives_the_padded_log_probs_packed(name):
    model = tiny_family_model(name)
    assert packing_problem(model) is None
    ids, mask = rows()
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9])
    with torch.no_grad():
        padded, padded_entropy = token_logprobs(model, ids, mask, temperature=temperature)
        packed, packed_entropy = packed_token_logprobs(model, ids, mask, packing_of(), temperature=temperature)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)
    torch.testing.assert_close(packed_entropy, padded_entropy, rtol=0, atol=1e-5)
    assert packing_of().cells < ids.numel()


def test_rows_longer_than_the_window_are_windowed_within_themselves_only():
    # Rows packed right after a long row: a window that leaked across rows would change their first tokens.
    assert max(LENGTHS) > WINDOW
    model = tiny_family_model("mistral")
    ids, mask = rows()
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask, with_entropy=False)
        packed, _ = packed_token_logprobs(model, ids, mask, packing_of(), with_entropy=False)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-6)


def test_gradients_through_the_packed_forward_are_the_padded_ones():
    ids, mask = rows()
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for packed in (False, True):
        model = build_model(64, 32, 2, 4, 64, seed=2)
        if packed:
            logprobs, _ = packed_token_logprobs(model, ids, mask, packing_of(), with_entropy=False)
        else:
            logprobs, _ = token_logprobs(model, ids, mask, with_entropy=False)
        (logprobs * weights).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for padded, packed in zip(*grads):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)


def test_only_wanted_tokens_get_log_probs_and_the_head_runs_only_there(monkeypatch):
    model = build_model(64, 32, 2, 4, 64, seed=3)
    ids, mask = rows()
    loss_mask = mask & (torch.arange(ids.shape[1])[None] >= torch.tensor([1, 9, 4, 15, 2, 5, 1, 10])[:, None])
    first = first_marked_rows(loss_mask)
    kept = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda module, args, output: kept.append(args[0].shape[:-1]))
    with torch.no_grad():
        padded, _ = token_logprobs(model, ids, mask)
        packed, entropy = packed_token_logprobs(model, ids, mask, packing_of(), from_tokens=first)
    wanted = mask & (torch.arange(ids.shape[1])[None] >= first[:, None])
    torch.testing.assert_close(packed[wanted], padded[wanted], rtol=0, atol=1e-6)
    assert not packed[~wanted].any() and not entropy[~wanted].any()
    if logprobs_module._mask_keep(model):  # where transformers has slice_logits_to_keep (5.20 has not)
        assert kept[-1] == (int(wanted.sum()),)  # the LM head saw the wanted positions only
    # Where the forward cannot trim by a boolean mask (transformers before slice_logits_to_keep), it computes every
    # position's logits and keeps the same values.
    monkeypatch.setattr(logprobs_module, "_mask_keep", lambda model: False)
    with torch.no_grad():
        untrimmed, _ = packed_token_logprobs(model, ids, mask, packing_of(), from_tokens=first)
    assert kept[-1] == (packing_of().packed_rows, packing_of().width)
    torch.testing.assert_close(untrimmed, packed, rtol=0, atol=1e-6)


def test_first_marked_rows_is_each_rows_first_marked_column():
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 1]], dtype=torch.bool)
    assert first_marked_rows(mask).tolist() == [1, 3, 0]


def test_models_that_cannot_be_packed_say_why():
    from flashreinforce.models.vision import VisionConfig, build_vision_lm

    vision = build_vision_lm(build_model(32, 32, 1, 2, 64), VisionConfig(image_token_id=5), seed=0)
    assert "reads images" in packing_problem(vision)
    flash = copy.deepcopy(build_model(11, 16, 1, 2, 16))
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in packing_problem(flash)
    assert "not among those tested packed" in packing_problem(torch.nn.Linear(2, 2))


def test_rows_that_want_no_log_prob_get_zeros():
    model = build_model(64, 32, 2, 4, 64, seed=3)
    ids, mask = rows()
    nothing = torch.full((ids.shape[0],), ids.shape[1])
    logprobs, entropies = packed_token_logprobs(model, ids, mask, packing_of(), from_tokens=nothing)
    assert logprobs.shape == ids.shape and not logprobs.any() and not entropies.any()
