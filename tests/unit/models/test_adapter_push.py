"""The adapter push format (models/adapter_push.py): read apart, refused when a part is missing or does not fit,
merged by the one formula the trainer's saves use."""

import pytest
import torch

from flashreinforce.models.adapter_push import (
    PROBE_IDS,
    PROBE_LENGTH,
    PROBE_LOGPROBS,
    AdapterLayer,
    adapter_only,
    is_adapter_push,
    lora_delta,
    merge_weight,
    merged_state,
    probe_row,
    read_push,
)


def push(base: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"layer.lora_A": torch.randn(2, 3, generator=g), "layer.lora_B": torch.randn(4, 2, generator=g),
             "layer.lora_scale": torch.tensor(0.5), PROBE_IDS: torch.arange(4), PROBE_LOGPROBS: torch.zeros(3)}
    if base:
        state.update({"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.zeros(4),
                      "other.weight": torch.ones(2, 2)})
    return state


def test_a_push_reads_into_layers_base_and_probe():
    read = read_push(push())
    assert list(read.layers) == ["layer"] and set(read.base) == {"layer.weight", "layer.bias", "other.weight"}
    assert read.layers["layer"].scale.shape == () and read.probe[0].tolist() == [0, 1, 2, 3]
    assert is_adapter_push(push()) and not is_adapter_push({"layer.weight": torch.zeros(1)})
    assert set(adapter_only(push())) == set(push(base=False))
    assert not read_push(push(base=False)).base


def test_merged_weights_are_the_base_plus_the_scaled_product_in_the_bases_dtype():
    state = push()
    merged = merged_state(state)
    assert set(merged) == {"layer.weight", "layer.bias", "other.weight"}
    expected = state["layer.weight"] + 0.5 * state["layer.lora_B"] @ state["layer.lora_A"]
    torch.testing.assert_close(merged["layer.weight"], expected, rtol=0, atol=1e-6)
    assert merged["other.weight"] is state["other.weight"]
    bf16 = merge_weight(state["layer.weight"].bfloat16(), read_push(state).layers["layer"])
    assert bf16.dtype == torch.bfloat16  # summed in fp32, rounded once to the base's dtype
    assert torch.equal(bf16, (state["layer.weight"].bfloat16().float() + lora_delta(
        state["layer.lora_A"], state["layer.lora_B"], state["layer.lora_scale"])).bfloat16())
    with pytest.raises(ValueError, match="without the base of layer.weight"):
        merged_state(push(base=False))


@pytest.mark.parametrize(("change", "match"), [
    ({"layer.lora_scale": None}, "layer layer has no lora_scale"),
    ({"layer.lora_B": torch.zeros(4, 3)}, r"A \(2, 3\), B \(4, 3\)"),
    ({"layer.lora_scale": torch.ones(2)}, "one scale"),
])
def test_a_layer_missing_a_part_or_whose_parts_do_not_fit_is_refused_by_name(change, match):
    state = push()
    for name, tensor in change.items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    with pytest.raises(ValueError, match=match):
        read_push(state)


def test_the_probe_row_is_fixed_and_never_banned():
    row = probe_row(50, banned={3, 7})
    assert len(row) == PROBE_LENGTH and row == probe_row(50, banned={3, 7})
    assert not {3, 7} & set(row) and all(0 <= t < 50 for t in row)


def test_lora_delta_is_pefts_get_delta_weight():
    layer = AdapterLayer(torch.randn(2, 3), torch.randn(4, 2), torch.tensor(2.0))
    torch.testing.assert_close(lora_delta(layer.a, layer.b, layer.scale), 2.0 * layer.b @ layer.a)
