import pytest
import torch
from model_families import REPLAYED_FAMILIES, tiny_family_model
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    PhimoeConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from flashreinforce.models import build_model
from flashreinforce.models.moe import (
    RouteRecorder,
    RouteReplay,
    gate_weights,
    moe_routers,
    route_shape,
    routing_problem,
)
from flashreinforce.rollout.engine import kv_cache_keyword

VOCAB, HIDDEN, LAYERS, HEADS, EXPERTS, K = 50, 32, 2, 4, 4, 2


def tiny_moe(dtype: torch.dtype | str = torch.float32, seed: int = 0):
    return build_model(
        VOCAB, HIDDEN, LAYERS, HEADS, 64, num_experts=EXPERTS, experts_per_token=K, dtype=dtype, seed=seed
    )


def tiny_qwen3_moe():
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def token_ids(batch: int = 2, length: int = 6, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def family_builder(name: str):
    """A builder of the family's tiny model (tests/model_families.py), as the replay tests take one."""
    return lambda: tiny_family_model(name, vocab_size=VOCAB)


REPLAYED = [tiny_moe, tiny_qwen3_moe, *(family_builder(name) for name in REPLAYED_FAMILIES)]
REPLAYED_IDS = ["build_model", "qwen3_moe_k3", *REPLAYED_FAMILIES]


def random_routes(batch: int, length: int, layers: int, k: int, experts: int, seed: int = 2) -> torch.Tensor:
    """(B, T, L, k) valid routes: k distinct experts per (token, layer), drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, length, layers, experts, generator=generator)  # (B, T, L, E)
    return keys.argsort(dim=-1)[..., :k]  # (B, T, L, k)


def record(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, L, k) the model's own routes on `ids`."""
    with torch.no_grad(), RouteRecorder(model) as recorder:
        model(ids)
        return recorder.take().reshape(*ids.shape, *route_shape(model))


def hook_counts(model) -> list[int]:
    """Forward hooks per router plus the model's pre-hooks (transformers adds its own on a first forward)."""
    return [len(router._forward_hooks) for router in moe_routers(model)] + [len(model._forward_pre_hooks)]


def experts_modules(model) -> list[torch.nn.Module]:
    """Each MoE layer's experts module, in layer order (a dense layer has none)."""
    return [module for module in model.modules() if type(module).__name__.endswith("Experts")]


def experts_inputs(model) -> tuple[list[torch.Tensor], list]:
    """The indices each MoE layer's experts module receives, seen from the experts' side (not our hooks)."""
    seen: list[torch.Tensor] = []
    handles = [
        experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
        for experts in experts_modules(model)
    ]
    return seen, handles


def test_dense_build_is_the_old_qwen2_weight_for_weight():
    # The dense path as it was before MoE support, as the reference.
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = build_model(VOCAB, HIDDEN, LAYERS, HEADS, 64, pad_token_id=0, eos_token_id=1, seed=3, num_experts=0)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.to_dict() == reference.config.to_dict()
    expected, got = reference.state_dict(), model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert moe_routers(model) == [] and route_shape(model) is None


def test_moe_build_is_a_seeded_all_sparse_qwen2_moe_in_fp32_and_bf16():
    torch.manual_seed(5)
    expected_next = torch.rand(1)
    torch.manual_seed(5)
    model = tiny_moe()
    assert torch.rand(1) == expected_next  # building did not consume the caller's random stream
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (EXPERTS, K, True)
    assert config.moe_intermediate_size == HIDDEN and config.shared_expert_intermediate_size == HIDDEN
    assert all(type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in model.model.layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight and config._attn_implementation == "sdpa"
    routers = moe_routers(model)
    assert all(router.weight.abs().min() > 0 for router in routers)  # randomly initialised, not zeros
    assert not torch.equal(routers[0].weight, routers[1].weight)
    again, other = tiny_moe(seed=0), tiny_moe(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(routers[0].weight, moe_routers(other)[0].weight)
    ids = token_ids()
    with torch.no_grad():
        logits = model(ids).logits
        bf16 = tiny_moe(dtype="bf16")
        bf16_logits = bf16(ids).logits
    assert logits.shape == (2, 6, VOCAB) and torch.isfinite(logits).all()
    assert bf16_logits.dtype == torch.bfloat16 and torch.isfinite(bf16_logits).all()
    assert moe_routers(bf16)[0].weight.dtype == torch.bfloat16


def test_bad_moe_arguments_name_the_argument():
    for kwargs, name in (
        ({"num_experts": 1}, "num_experts"),
        ({"num_experts": -2}, "num_experts"),
        ({"num_experts": 4, "experts_per_token": 0}, "experts_per_token"),
        ({"num_experts": 4, "experts_per_token": 5}, "experts_per_token"),
        ({"num_experts": 4, "intermediate_size": 64}, "intermediate_size"),
        ({"moe_intermediate_size": 16}, "moe_intermediate_size"),
    ):
        with pytest.raises(ValueError, match=f"^{name}="):
            build_model(VOCAB, HIDDEN, 1, HEADS, **kwargs)


def test_routers_and_route_shape_cover_the_replayed_families_and_refuse_the_rest():
    model = tiny_moe()
    assert moe_routers(model) == [layer.mlp.gate for layer in model.model.layers]
    assert route_shape(model) == (LAYERS, K)
    qwen3 = tiny_qwen3_moe()
    assert [type(router).__name__ for router in moe_routers(qwen3)] == ["Qwen3MoeTopKRouter"] * LAYERS
    assert route_shape(qwen3) == (LAYERS, 3)
    assert all(router.weight.abs().min() > 0 for router in moe_routers(qwen3))
    # DeepSeek's first layer is dense (first_k_dense_replace=1): 3 MoE layers of 4
    shapes = {name: route_shape(family_builder(name)()) for name in REPLAYED_FAMILIES}
    assert shapes == {name: (3 if name.startswith("deepseek") else 4, 2) for name in REPLAYED_FAMILIES}
    dbrx = tiny_family_model("dbrx")
    assert "DbrxFFN.route_tokens_to_experts" in routing_problem(dbrx)
    phimoe = AutoModelForCausalLM.from_config(PhimoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0,
    ))
    for call in (moe_routers, route_shape, RouteRecorder):
        with pytest.raises(ValueError, match=r"PhimoeForCausalLM .*PhimoeTopKRouter.*replay is not supported"):
            call(phimoe)
        with pytest.raises(ValueError, match=r"DbrxForCausalLM cannot have its routes recorded or replayed"):
            call(dbrx)
    assert routing_problem(build_model(VOCAB, HIDDEN, 1, HEADS)) is None and routing_problem(model) is None
    with pytest.raises(ValueError, match="no routers"):
        RouteRecorder(build_model(VOCAB, HIDDEN, 1, HEADS))


def test_recorder_captures_the_top_k_of_the_router_probs_and_removes_its_hooks():
    model = tiny_moe()
    ids = token_ids()
    with torch.no_grad():
        model(ids, output_router_logits=True)  # lets transformers install its own output-recording hooks
    before = hook_counts(model)
    with torch.no_grad(), RouteRecorder(model) as recorder:
        outputs = model(ids, output_router_logits=True)
        routes = recorder.take()  # (N, L, k)
        with pytest.raises(RuntimeError, match="exactly one forward"):
            recorder.take()
        model(ids)
        model(ids)
        with pytest.raises(RuntimeError, match=r"ran \[2, 2\] times"):
            recorder.take()
    assert routes.dtype == torch.int16 and routes.shape == (2 * 6, LAYERS, K)
    for layer, logits in enumerate(outputs.router_logits):  # (N, E) each
        expected = torch.softmax(logits.float(), dim=-1).topk(K, dim=-1).indices  # (N, k)
        assert torch.equal(routes[:, layer].long(), expected)
    assert hook_counts(model) == before
    with pytest.raises(ZeroDivisionError), RouteRecorder(model):
        raise ZeroDivisionError("a forward that fails inside the block")
    assert hook_counts(model) == before


@pytest.mark.parametrize("build", REPLAYED, ids=REPLAYED_IDS)
def test_replay_makes_every_layer_use_the_recorded_experts(build):
    model = build()
    layers, k = route_shape(model)
    ids = token_ids()
    routes = random_routes(2, 6, layers, k, moe_routers(model)[0].num_experts)  # (B, T, L, k)
    seen, handles = experts_inputs(model)
    with torch.no_grad(), RouteReplay(model, routes) as replay, RouteRecorder(model) as recorder:
        model(ids)
        recorded = recorder.take()  # (N, L, k): the recorder sits after the replay, so sees its output
    for handle in handles:
        handle.remove()
    flat = routes.reshape(-1, layers, k)  # (N, L, k)
    for layer in range(layers):
        assert torch.equal(seen[layer], flat[:, layer])  # what the experts received, in recorded order
        assert torch.equal(recorded[:, layer].long(), flat[:, layer])
    mismatched, replayed = replay.disagreement()
    assert replayed == 2 * 6 * layers and 0 < mismatched <= replayed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", REPLAYED, ids=REPLAYED_IDS)
def test_replaying_the_models_own_routes_is_bitwise_a_plain_forward(build, dtype):
    model = build().to(dtype)
    ids = token_ids(3, 7)
    with torch.no_grad():
        plain = model(ids).logits
    routes = record(model, ids)
    with torch.no_grad(), RouteReplay(model, routes.int()) as replay:
        replayed = model(ids).logits
    assert torch.equal(replayed, plain)
    layers, _ = route_shape(model)
    assert replay.disagreement() == (0, 3 * 7 * layers)


def test_router_weights_get_gradients_and_the_gates_are_the_restricted_softmax():
    model = tiny_moe()
    ids = token_ids()
    own = record(model, ids)
    routes = random_routes(2, 6, LAYERS, K, EXPERTS, seed=4)
    assert not torch.equal(routes.sort(-1).values, own.long().sort(-1).values)
    gates: list[torch.Tensor] = []
    router_logits: list[torch.Tensor] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: gates.append(args[2].detach()))
               for layer in model.model.layers]
    handles += [router.register_forward_hook(lambda m, args, out: router_logits.append(out[0]))
                for router in moe_routers(model)]
    with RouteReplay(model, routes):
        # No output_router_logits: its load-balancing loss would give the routers gradients of its own.
        model(ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    flat = routes.reshape(-1, LAYERS, K)
    for layer, logits in enumerate(router_logits):  # (N, E)
        chosen = logits.detach().gather(-1, flat[:, layer]).exp()  # (N, k): exp(s_e) for e in the recorded set
        torch.testing.assert_close(gates[layer], chosen / chosen.sum(-1, keepdim=True))
        assert torch.equal(gates[layer], gate_weights(moe_routers(model)[layer])(
            moe_routers(model)[layer], logits.detach(), flat[:, layer]))


def textbook_gates(router, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each family's gate weights of the chosen experts as its paper writes them, in float64."""
    scores, kind = logits.double(), type(router).__name__
    if kind.startswith("GptOss"):  # softmax over the chosen experts' logits
        return scores.gather(-1, chosen).softmax(-1)
    if kind.startswith("DeepseekV3"):  # sigmoid, renormalised over the chosen
        gates = scores.sigmoid().gather(-1, chosen)
    else:  # softmax over all experts, renormalised over the chosen where the router says so (Mixtral always)
        gates = scores.softmax(-1).gather(-1, chosen)
    if kind.startswith("Mixtral") or getattr(router, "norm_topk_prob", False):
        gates = gates / gates.sum(-1, keepdim=True)
    return gates * getattr(router, "routed_scaling_factor", 1.0)


@pytest.mark.parametrize("name", REPLAYED_FAMILIES)
def test_each_family_weighs_replayed_experts_as_its_router_does_and_its_router_learns(name):
    model = family_builder(name)()
    routers = moe_routers(model)
    layers, k = route_shape(model)
    ids = token_ids()
    routes = random_routes(2, 6, layers, k, routers[0].num_experts, seed=4)
    assert not torch.equal(routes.sort(-1).values, record(model, ids).long().sort(-1).values)
    gates, router_logits = [], []
    handles = [experts.register_forward_pre_hook(lambda m, args: gates.append(args[2].detach()))
               for experts in experts_modules(model)]
    handles += [router.register_forward_hook(lambda m, args, out: router_logits.append(out[0].detach()))
                for router in routers]
    with RouteReplay(model, routes):
        model(ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    flat = routes.reshape(-1, layers, k)  # (N, L, k)
    for layer, router in enumerate(routers):
        expected = textbook_gates(router, router_logits[layer], flat[:, layer])
        torch.testing.assert_close(gates[layer].double(), expected, rtol=1e-5, atol=1e-6)
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_minus_one_rows_use_the_live_choice_and_disagreement_counts_exactly():
    model = tiny_moe()
    ids = token_ids()  # (2, 6): 12 positions, 24 (token, layer) pairs
    own = record(model, ids).long()  # (B, T, L, k)
    routes = own.clone()
    other = [e for e in range(EXPERTS) if e not in own[0, 0, 0].tolist()]
    routes[0, 0, 0] = torch.tensor(other[:K])  # a different set: counted
    routes[0, 1, 1] = own[0, 1, 1].flip(0)  # the same set in another order: not counted
    routes[1, 2] = -1  # both layers unrecorded: live choice, not in the denominator
    routes[1, 3, 0] = -1  # one layer unrecorded
    seen, handles = experts_inputs(model)
    with torch.no_grad(), RouteReplay(model, routes) as replay:
        model(ids)
        model(ids)
    for handle in handles:
        handle.remove()
    assert torch.equal(seen[0][6 + 2], own[1, 2, 0]) and torch.equal(seen[1][6 + 2], own[1, 2, 1])
    assert torch.equal(seen[0][6 + 3], own[1, 3, 0]) and torch.equal(seen[1][6 + 3], own[1, 3, 1])
    assert torch.equal(seen[0][0], routes[0, 0, 0])
    assert replay.disagreement() == (2 * 1, 2 * (24 - 3))  # two forwards inside the block


def test_one_replay_serves_grad_no_grad_and_inference_mode_forwards():
    model = tiny_moe()
    ids = token_ids()
    routes = random_routes(2, 6, LAYERS, K, EXPERTS)
    with torch.no_grad():
        model(ids)
    before = hook_counts(model)
    with RouteReplay(model, routes) as replay:
        with torch.inference_mode():
            first = model(ids).logits
        trained = model(ids, labels=ids)
        trained.loss.backward()
        with torch.no_grad():
            last = model(ids).logits
    assert torch.equal(first, trained.logits.detach()) and torch.equal(first, last)
    assert replay.disagreement()[1] == 3 * 2 * 6 * LAYERS
    assert hook_counts(model) == before


def test_bad_routes_are_refused_with_the_reason():
    model = tiny_moe()
    good = random_routes(2, 6, LAYERS, K, EXPERTS)
    duplicate, mixed, outside = good.clone(), good.clone(), good.clone()
    duplicate[0, 0, 0] = 1
    mixed[0, 0, 0, 0] = -1
    outside[1, 1, 1, 1] = EXPERTS
    for routes, reason in (
        (good[:, :, :1], r"\(B, T, L=2, k=2\)"),
        (good[..., :1], r"\(B, T, L=2, k=2\)"),
        (good.float(), "integer"),
        (duplicate, "same expert twice"),
        (mixed, "not mixed"),
        (outside, r"outside \[0, 4\)"),
    ):
        with pytest.raises(ValueError, match=reason):
            RouteReplay(model, routes)
    wrong_shape = r"routes cover \(B, T\) = \(2, 6\) but the forward's input is \(3, 4\)"
    with pytest.raises(ValueError, match=wrong_shape), torch.no_grad(), RouteReplay(model, good):
        model(token_ids(3, 4))


def test_routes_recorded_token_by_token_with_a_kv_cache_equal_the_full_forward_routes():
    model = tiny_moe()
    ids = token_ids(1, 12)
    full = record(model, ids)[0]  # (T, L, k)
    steps = []
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), RouteRecorder(model) as recorder:
        for position in range(ids.shape[1]):
            model(ids[:, position:position + 1], **{kv_cache_keyword(model): cache}, use_cache=True)
            steps.append(recorder.take())  # (1, L, k)
    assert cache.get_seq_length() == ids.shape[1]
    incremental = torch.cat(steps)  # (T, L, k)
    assert torch.equal(incremental, full)  # exactly, in fp32, on this tiny model
