import torch

from flashreinforce.rollout.kv_cache import SlotCache


def states(rows, heads, q, fill):
    return torch.full((rows, heads, q, 3), float(fill)), torch.full((rows, heads, q, 3), float(-fill))


def test_decode_writes_each_slot_at_its_own_position_and_returns_a_view():
    cache = SlotCache(num_slots=4, max_context=8)
    cache.plan_prefill(first_slot=0, num_rows=2, length=3)
    k, v = cache.update(*states(2, 2, 3, fill=1), layer_idx=0)
    assert k.shape == (2, 2, 3, 3)  # a fresh prefill attends to its own states only
    cache.plan_decode(torch.tensor([3, 1]), kv_length=4)
    k, v = cache.update(*states(2, 2, 1, fill=7), layer_idx=0)
    assert k.shape == (2, 2, 4, 3) and k.data_ptr() == cache._keys[0].data_ptr()  # no copy
    assert k[0, 0, :, 0].tolist() == [1, 1, 1, 7] and k[1, 0, :, 0].tolist() == [1, 7, 1, 0]
    assert v[1, 1, 1, 0] == -7


def test_move_copies_slots_to_keep_running_requests_compact():
    cache = SlotCache(num_slots=3, max_context=4)
    cache.plan_prefill(first_slot=0, num_rows=3, length=2)
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 3).clone()
    cache.update(keys, -keys, layer_idx=0)
    cache.move(src=[2], dst=[0], length=2)
    assert cache._keys[0][:, 0, :2, 0].tolist() == [[2, 2], [1, 1], [2, 2]]
    assert cache._values[0][0, 0, 0, 0] == -2


def test_decode_of_chosen_slots_writes_them_and_reads_their_prefixes_only():
    cache = SlotCache(num_slots=4, max_context=8)
    cache.plan_prefill(first_slot=0, num_rows=3, length=5)
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 5, 3).clone()  # slot s holds s everywhere
    cache.update(keys, -keys, layer_idx=0)
    cache.plan_decode(torch.tensor([1, 2]), kv_length=3, slots=torch.tensor([2, 0]))
    k, v = cache.update(*states(2, 1, 1, fill=9), layer_idx=0)
    assert k.shape == (2, 1, 3, 3)  # rows in the order asked, positions [0, 3)
    assert k[:, 0, :, 0].tolist() == [[2, 9, 2], [0, 0, 9]]
    assert v[0, 0, 1, 0] == -9
    assert cache._keys[0][1, 0, :, 0].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]  # an unchosen slot is untouched


def test_sliding_layers_read_from_the_window_start_and_full_layers_from_zero():
    cache = SlotCache(num_slots=3, max_context=10, sliding_layers=frozenset({1}))
    cache.plan_prefill(first_slot=0, num_rows=3, length=8)
    keys = torch.arange(8.0)[None, None, :, None].expand(3, 1, 8, 3).clone()  # position p holds p
    for layer in (0, 1):
        cache.update(keys, -keys, layer_idx=layer)
    cache.plan_decode(torch.tensor([8, 6]), kv_length=9, window_start=4)
    full, _ = cache.update(*states(2, 1, 1, fill=9), layer_idx=0)
    sliding, values = cache.update(*states(2, 1, 1, fill=9), layer_idx=1)
    assert full.shape == (2, 1, 9, 3) and sliding.shape == (2, 1, 5, 3)
    assert sliding[0, 0, :, 0].tolist() == [4, 5, 6, 7, 9] and sliding[1, 0, :, 0].tolist() == [4, 5, 9, 7, 0]
    assert values[1, 0, 2, 0] == -9
    assert cache._keys[1][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 0]  # every position is kept
    cache.plan_decode(torch.tensor([7]), kv_length=8, slots=torch.tensor([2]), window_start=3)
    chosen, _ = cache.update(*states(1, 1, 1, fill=5), layer_idx=1)
    assert chosen[0, 0, :, 0].tolist() == [3, 4, 5, 6, 5]
