"""The Ray backend (controller/ray_backend.py) over real actors on a local Ray: the Backend contract over two
engine actors, weight pushes with their version, and what happens when an engine, a verifier actor or a
trainer rank dies or hangs.

One Ray session and one backend (two engines, one trainer rank, one verifier actor) serve the whole module:
each start costs seconds. Tests that break an actor leave the backend healthy again for the next one.
"""

import asyncio
import dataclasses
import time

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from flashreinforce.config import load_config  # noqa: E402
from flashreinforce.controller.ray_backend import _POLL_S, RayParts, start_ray_backend  # noqa: E402
from flashreinforce.controller.ray_cluster import resolve_devices  # noqa: E402
from flashreinforce.controller.ray_trainer import RayTrainer  # noqa: E402
from flashreinforce.controller.ray_verifiers import RayVerifiers  # noqa: E402
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory  # noqa: E402
from flashreinforce.run.backends import build_ray_trainer, ray_settings, verifier_options  # noqa: E402
from flashreinforce.run.data import load_data  # noqa: E402
from flashreinforce.run.engines import EngineShape, build_engine, longest_rendered  # noqa: E402
from flashreinforce.run.policy import tiny_policy  # noqa: E402
from flashreinforce.trainer.group import TrainerRankError  # noqa: E402
from flashreinforce.types import RolloutKey, SamplingParams, Verdict  # noqa: E402

pytestmark = pytest.mark.ray

HEALTH_S = 4.0
SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "data.arithmetic.num_train=64", "data.arithmetic.num_eval=8", "rollout.max_batch_size=16",
         "rollout.max_new_tokens=40", "trainer.microbatch_size=8", "verifier.min_workers=1", "verifier.max_workers=2",
         "backend.kind=ray", "backend.num_engines=2", f"backend.health_timeout_s={HEALTH_S}"]
PARAMS = SamplingParams(max_new_tokens=40, temperature=1.0)


@pytest.fixture(scope="module")
def session(local_ray):
    """Every test here runs on the module's Ray (tests/conftest.py)."""


class Setup:
    """The module's config, data, policy and backend."""

    def __init__(self, *overrides: str) -> None:
        self.config = load_config(None, [*SMALL, *overrides])
        self.data = load_data(self.config)
        self.policy = tiny_policy(self.config)
        self.episodes = TextEpisodes(self.policy.tokenizer)
        self.shape = EngineShape(longest_rendered(self.episodes, self.data.train), PARAMS.max_new_tokens, 0, 0)
        self.parts = RayParts(build_engine=build_engine, build_trainer=build_ray_trainer,
                              verifier_options=verifier_options(self.config, workers=1), config=self.config,
                              policy=self.policy, shape=self.shape)
        self.settings = ray_settings(self.config)

    def prompt_ids(self, i: int) -> list[int]:
        return self.episodes.prompt_ids(self.data.train[i % len(self.data.train)])


@pytest.fixture(scope="module")
def setup(session):
    return Setup()


@pytest.fixture(scope="module")
def backend(setup, loop):
    backend = start_ray_backend(setup.settings, setup.parts)
    yield backend
    loop.run_until_complete(backend.close())


def submit(backend, setup, ids, start=0):
    for n, rid in enumerate(ids):
        backend.submit(rid, setup.prompt_ids(start + n), PARAMS)


async def drain(backend, ids, timeout_s=60.0):
    """Every generation of `ids` from finished(), checking none comes twice."""
    got, deadline = {}, time.monotonic() + timeout_s
    while set(got) != set(ids):
        for generation in await asyncio.wait_for(backend.finished(), deadline - time.monotonic()):
            assert generation.request_id not in got, f"{generation.request_id} was delivered twice"
            got[generation.request_id] = generation
    return got


async def until_healthy(backend, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not all(e.healthy for e in backend.engines):
        assert time.monotonic() < deadline, "an engine did not come back"
        await asyncio.sleep(0.1)


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_requests_go_to_both_engines_and_come_back_once(backend, setup, loop):
    ids = [f"r{i}" for i in range(24)]

    async def run():
        submit(backend, setup, ids)
        await asyncio.sleep(0)  # the submits of one turn go out together, one call per engine
        loads = [len(e.requests) for e in backend.engines]
        return loads, await drain(backend, ids)

    loads, got = loop.run_until_complete(run())
    assert loads == [12, 12]  # least loaded first
    assert backend.in_flight == 0 and backend.free_slots == 2 * 16
    assert all(g.finish_reason in ("stop", "length") and g.token_ids for g in got.values())
    assert all(set(g.policy_versions) == {0} for g in got.values())
    assert all(e.stats.sampled_tokens > 0 for e in backend.engines)
    assert backend.stats()["engine/sampled_tokens"] == sum(len(g.token_ids) for g in got.values())


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_pause_abort_resume_keep_every_prefix(backend, setup, loop):
    ids = [f"p{i}" for i in range(24)]

    async def run():
        submit(backend, setup, ids)
        partials, finished = await backend.pause()
        assert backend.in_flight == 0, "paused requests are held, not in flight"
        held = {p.request_id: p for p in partials}
        assert held and set(held) | {g.request_id for g in finished} == set(ids)
        assert not set(held) & {g.request_id for g in finished}
        dropped = sorted(held)[: len(held) // 2]
        aborted = await backend.abort(dropped)
        assert [p.request_id for p in aborted] == dropped
        keep = [held[i] for i in sorted(held) if i not in dropped]
        await backend.resume(keep)
        resumed = await drain(backend, [p.request_id for p in keep])
        return keep, resumed

    keep, resumed = loop.run_until_complete(run())
    for partial in keep:  # a resumed request goes on from its partial exactly
        tokens = resumed[partial.request_id].token_ids
        assert tokens[: len(partial.token_ids)] == partial.token_ids
        assert resumed[partial.request_id].behavior_logprobs[: len(partial.token_ids)] == partial.behavior_logprobs


def _train_once(backend, setup, loop):
    """Generate, score and train one step on the generations; returns the metrics."""
    ids = [f"t{i}" for i in range(8)]

    async def run():
        submit(backend, setup, ids)
        got = await drain(backend, ids)
        generations = [got[i] for i in ids]
        prompts = [setup.data.train[i] for i in range(len(ids))]
        verdicts = await backend.score([(setup.episodes.decode(g.token_ids), p) for g, p in zip(generations, prompts)])
        batch = [to_trajectory(RolloutKey(p.id, 0), p, i, g, v)
                 for i, (p, g, v) in enumerate(zip(prompts, generations, verdicts))]
        return await backend.train(batch)

    return loop.run_until_complete(run())


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_push_weights_gives_every_engine_the_trainers_version(backend, setup, loop, tmp_path):
    metrics = _train_once(backend, setup, loop)
    assert "loss/policy" in metrics and backend.trainer.version == 1
    assert loop.run_until_complete(backend.push_weights()) == 1
    assert [ray.get(e.actor.ping.remote()) for e in backend.engines] == [1, 1]
    weights = ray.get(backend.trainer.weights_ref())
    ids = [f"w{i}" for i in range(8)]

    async def run():
        submit(backend, setup, ids)
        return await drain(backend, ids)

    got = loop.run_until_complete(run())
    assert all(set(g.policy_versions) == {1} for g in got.values())
    assert backend.stats()["engine/version"] == 1.0
    # a checkpoint's model is rank 0's, written by this process (the actor may be on another machine)
    backend.save_model(tmp_path / "model")
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert saved.keys() <= weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
    assert (tmp_path / "model" / "tokenizer.json").is_file()


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_a_killed_engine_restarts_with_the_current_weights_and_loses_nothing(backend, setup, loop):
    state = backend.state_dict()
    backend.load_state_dict({**state, "version": 7})  # the version a run resumed at, say
    assert loop.run_until_complete(backend.push_weights()) == 7
    restarts = backend.counts["engine_restarts"]
    ids = [f"k{i}" for i in range(24)]

    async def run():
        submit(backend, setup, ids)
        await asyncio.sleep(0)
        ray.kill(backend.engines[0].actor, no_restart=False)  # Ray restarts it: only its constructor runs again
        got = await drain(backend, ids)
        await until_healthy(backend)
        return got

    got = loop.run_until_complete(run())
    assert backend.counts["engine_restarts"] == restarts + 1
    assert sorted(got) == sorted(ids)  # the lost engine's requests finished on the other one
    assert ray.get(backend.engines[0].actor.ping.remote()) == 7, "a restarted engine takes work at the current version"
    more = [f"m{i}" for i in range(8)]

    async def after():
        submit(backend, setup, more)
        return await drain(backend, more)

    later = loop.run_until_complete(after())
    assert backend.engines[0].stats.sampled_tokens > 0, "the restarted engine takes work again"
    assert all(set(g.policy_versions) == {7} for g in [*got.values(), *later.values()])


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_an_engine_found_dead_by_a_pause_has_its_requests_requeued_and_handed_back(backend, setup, loop):
    requeued = backend.counts["requeued_requests"]
    ids = [f"p{i}" for i in range(24)]

    async def run():
        submit(backend, setup, ids)
        await asyncio.sleep(0)
        held = len(backend.engines[0].requests)
        ray.kill(backend.engines[0].actor, no_restart=False)
        partials, done = await backend.pause()  # no poll runs meanwhile: the pause is what finds it dead
        await backend.resume(partials)
        got = await drain(backend, [p.request_id for p in partials])
        await until_healthy(backend)
        return held, partials, done, got

    held, partials, done, got = loop.run_until_complete(run())
    assert held == 12 and backend.counts["requeued_requests"] == requeued + held
    assert sorted([p.request_id for p in partials] + [g.request_id for g in done]) == sorted(ids)
    assert sorted(got) == sorted(p.request_id for p in partials)


@pytest.mark.slow
def test_a_hung_engine_is_detected_within_its_deadline(backend, setup, loop):
    restarts = backend.counts["engine_restarts"]
    ids = [f"h{i}" for i in range(16)]

    async def run():
        submit(backend, setup, ids)
        await asyncio.sleep(0)
        hung = time.monotonic()
        backend.engines[1].actor.__ray_call__.remote(lambda actor: time.sleep(120))  # blocks its event loop
        got = await drain(backend, ids)
        while backend.counts["engine_restarts"] == restarts:
            await asyncio.sleep(0.05)
        detected = time.monotonic() - hung
        await until_healthy(backend)
        return got, detected

    got, detected = loop.run_until_complete(run())
    assert sorted(got) == sorted(ids)
    assert detected < _POLL_S + HEALTH_S + 3.0, f"a hung engine took {detected:.1f} s to notice"


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_a_killed_verifier_actor_is_replaced_and_its_items_scored_again(setup, loop, tmp_path):
    reward = tmp_path / "slow_reward.py"
    reward.write_text("import time\n\ndef reward(completion, ground_truth, prompt):\n"
                      "    time.sleep(0.3)\n    return completion == ground_truth\n")
    config = load_config(None, [*SMALL, f"verifier.reward_fn={reward}:reward"])
    verifiers = RayVerifiers(ray_settings(config), verifier_options(config, workers=1), "test-verifiers")
    try:
        verifiers.wait_ready()
        prompts = setup.data.train[:8]
        items = [(p.ground_truth if i % 2 else "nope", p) for i, p in enumerate(prompts)]

        async def run():
            scoring = asyncio.ensure_future(verifiers.score(items))
            await asyncio.sleep(0.8)  # mid-way through the 8 calls of 0.3 s
            ray.kill(verifiers.active[0].actor, no_restart=False)
            return await scoring

        verdicts = loop.run_until_complete(run())
        assert [v.passed for v in verdicts] == [bool(i % 2) for i in range(8)]
        assert verifiers.stats()["replaced"] == 1
    finally:
        verifiers.close()


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_verifier_actors_grow_with_the_queue_up_to_max_workers(setup, loop):
    verifiers = RayVerifiers(setup.settings, verifier_options(setup.config, workers=1), "test-grow")
    try:
        verifiers.wait_ready()
        items = [("1", p) for p in setup.data.train[:40]]  # deeper than one actor's share

        async def run():
            first = await verifiers.score(items)
            deadline = time.monotonic() + 60
            while len(verifiers.active) < 2:
                assert time.monotonic() < deadline, "no second verifier actor started"
                await asyncio.sleep(0.1)
            return first, await verifiers.score(items)

        first, second = loop.run_until_complete(run())
        assert [(v.reward, v.reason) for v in first] == [(v.reward, v.reason) for v in second] and len(first) == 40
        assert len(verifiers.active) == setup.config.verifier.max_workers == 2
    finally:
        verifiers.close()


async def _rows(backend, setup, ids):
    """Trajectories of the first len(ids) training prompts, generated by the backend and scored."""
    submit(backend, setup, ids)
    got = await drain(backend, ids)
    prompts = setup.data.train[:len(ids)]
    verdicts = await backend.score([(setup.episodes.decode(got[i].token_ids), p) for i, p in zip(ids, prompts)])
    return [to_trajectory(RolloutKey(p.id, 0), p, n, got[i], v)
            for n, (i, p, v) in enumerate(zip(ids, prompts, verdicts))]


@pytest.mark.slow
def test_a_killed_trainer_rank_fails_the_step_loudly(backend, setup, loop):
    """Two data-parallel ranks (gloo) step like one; when one dies the step raises, naming it and the resume."""
    settings = ray_settings(load_config(None, [*SMALL, "trainer.world_size=2"]))
    trainer = RayTrainer.start(settings, build_ray_trainer, setup.config, ray.put(setup.policy), "test-dp")
    try:
        rows = loop.run_until_complete(_rows(backend, setup, [f"d{i}" for i in range(8)]))
        loop.run_until_complete(trainer.step(rows))
        rank0, rank1 = ray.get([rank.weights.remote() for rank in trainer.ranks])
        assert all((rank0[name] - rank1[name]).abs().max() < 1e-6 for name in rank0)
        ray.kill(trainer.ranks[1], no_restart=True)
        with pytest.raises(TrainerRankError, match=r"rank 1 of 2 .* died .*--resume"):
            loop.run_until_complete(trainer.step(rows))
        with pytest.raises(TrainerRankError, match="stopped"):
            trainer.state_dict()
    finally:
        trainer.close()


@pytest.mark.slow
def test_fsdp_trainer_ranks_publish_save_and_checkpoint_the_full_model(backend, setup, loop, tmp_path):
    """trainer.sharding=fsdp on two rank actors: each read (weights, state, model) is a collective of both, and
    rank 0 answers with the full tensors under the model's own names and shapes."""
    config = load_config(None, [*SMALL, "trainer.world_size=2", "trainer.sharding=fsdp"])
    settings = ray_settings(config)
    assert settings.sharded_trainer
    trainer = RayTrainer.start(settings, build_ray_trainer, config, ray.put(setup.policy), "test-fsdp")
    try:
        initial = {name: tensor.clone() for name, tensor in setup.policy.model.state_dict().items()}
        rows = loop.run_until_complete(_rows(backend, setup, [f"f{i}" for i in range(8)]))
        # rewards that differ, so the advantages and the gradient are not all zero
        rows = [dataclasses.replace(row, verdict=Verdict(reward=float(n % 2), passed=n % 2 == 1))
                for n, row in enumerate(rows)]
        metrics = loop.run_until_complete(trainer.step(rows))
        assert metrics["optim/grad_norm"] > 0
        weights = ray.get(trainer.weights_ref())
        assert {n: t.shape for n, t in weights.items()} == {n: t.shape for n, t in initial.items()}
        assert any(not torch.equal(weights[n], initial[n]) for n in initial), "the step moved no weight"
        loop.run_until_complete(trainer.step(rows))  # the peer's part of the read is settled first
        assert trainer.version == 2
        state = trainer.state_dict()
        assert state["sharding"] == "fsdp" and state["version"] == 2
        files = trainer.model_files()
        (tmp_path / "model.safetensors").write_bytes(files["model.safetensors"])
        saved = load_file(tmp_path / "model.safetensors")
        latest = ray.get(trainer.weights_ref())
        assert all(torch.equal(saved[name], latest[name]) for name in saved)
    finally:
        trainer.close()


def test_the_lockstep_loop_is_refused_on_ray_naming_the_fields():
    from flashreinforce.run.backends import check_buildable

    with pytest.raises(ValueError, match="deterministic=true .* needs backend.kind=local"):
        check_buildable(load_config(None, [*SMALL, "deterministic=true"]))


# ---- backend.weight_sync=broadcast ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broadcasting(setup, loop):
    """A second backend whose pushes go through the weight group (gloo here), beside the module's own."""
    settings = resolve_devices(ray_settings(load_config(None, [*SMALL, "backend.weight_sync=broadcast"])),
                               ray.cluster_resources())
    assert (settings.weight_sync, settings.weight_backend) == ("broadcast", "gloo")
    backend = start_ray_backend(settings, setup.parts)
    yield backend
    loop.run_until_complete(backend.close())


def _train_moving(backend, setup, loop, tag):
    """One optimizer step that moves the weights: rewards that differ, so the advantages are not all zero."""
    rows = loop.run_until_complete(_rows(backend, setup, [f"{tag}{i}" for i in range(8)]))
    rows = [dataclasses.replace(row, verdict=Verdict(reward=float(n % 2), passed=n % 2 == 1))
            for n, row in enumerate(rows)]
    loop.run_until_complete(backend.train(rows))


def _engine_weights(engine):
    return ray.get(engine.actor.__ray_call__.remote(
        lambda actor: {name: t.clone() for name, t in actor.engine.engine.model.state_dict().items()}))


def _assert_engines_hold_rank_0s_weights(backend):
    expected = ray.get(backend.trainer.weights_ref())
    for engine in backend.engines:
        held = _engine_weights(engine)
        assert all(torch.equal(held[name], tensor) for name, tensor in expected.items()), engine.name


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_a_broadcast_push_gives_every_engine_rank_0s_weights_bit_for_bit(broadcasting, setup, loop):
    before = _engine_weights(broadcasting.engines[0])
    _train_moving(broadcasting, setup, loop, "s")
    assert loop.run_until_complete(broadcasting.push_weights()) == 1
    assert broadcasting.counts["weight_broadcasts"] == 1 and broadcasting.counts["weight_broadcast_fallbacks"] == 0
    assert [ray.get(e.actor.ping.remote()) for e in broadcasting.engines] == [1, 1]
    _assert_engines_hold_rank_0s_weights(broadcasting)
    after = _engine_weights(broadcasting.engines[0])
    assert any(not torch.equal(before[name], after[name]) for name in before), "the push changed no weight"
    ids = [f"b{i}" for i in range(8)]

    async def run():
        submit(broadcasting, setup, ids)
        return await drain(broadcasting, ids)

    assert all(set(g.policy_versions) == {1} for g in loop.run_until_complete(run()).values())


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_an_engine_that_misses_a_broadcast_gets_the_weights_through_the_object_store(broadcasting, setup, loop):
    """Engine 0 leaves the group before a push: it cannot receive, the push falls back for whoever missed it,
    and the next push builds a new generation that reaches both engines again."""
    ray.get(broadcasting.engines[0].actor.__ray_call__.remote(lambda actor: actor.leave_weight_group()))
    fallbacks = broadcasting.counts["weight_broadcast_fallbacks"]
    generation = broadcasting._broadcaster.generation
    _train_moving(broadcasting, setup, loop, "m")
    version = loop.run_until_complete(broadcasting.push_weights())
    assert broadcasting.counts["weight_broadcast_fallbacks"] == fallbacks + 1
    assert [ray.get(e.actor.ping.remote()) for e in broadcasting.engines] == [version, version]
    _assert_engines_hold_rank_0s_weights(broadcasting)
    assert all(e.healthy for e in broadcasting.engines), "a missed broadcast is not a lost engine"
    _train_once(broadcasting, setup, loop)
    version = loop.run_until_complete(broadcasting.push_weights())
    assert broadcasting.counts["weight_broadcast_fallbacks"] == fallbacks + 1, "the new generation reached both"
    assert broadcasting._broadcaster.generation == generation + 1 and broadcasting._broadcaster.failures == 0
    assert [ray.get(e.actor.ping.remote()) for e in broadcasting.engines] == [version, version]
    _assert_engines_hold_rank_0s_weights(broadcasting)


@pytest.mark.slow  # real Ray actors (the module's backend starts in ~15 s)
def test_a_killed_engine_catches_up_from_rank_0_and_rejoins_the_group(broadcasting, setup, loop):
    """After a broadcast nothing in the object store holds the weights: a restarted engine loads rank 0's
    versioned weights, and the next push builds a group with it again."""
    _train_once(broadcasting, setup, loop)
    version = loop.run_until_complete(broadcasting.push_weights())
    restarts, generation = broadcasting.counts["engine_restarts"], broadcasting._broadcaster.generation
    ids = [f"kb{i}" for i in range(16)]

    async def run():
        submit(broadcasting, setup, ids)
        await asyncio.sleep(0)
        ray.kill(broadcasting.engines[1].actor, no_restart=False)
        got = await drain(broadcasting, ids)
        await until_healthy(broadcasting)
        return got

    got = loop.run_until_complete(run())
    assert sorted(got) == sorted(ids) and broadcasting.counts["engine_restarts"] == restarts + 1
    assert ray.get(broadcasting.engines[1].actor.ping.remote()) == version
    _assert_engines_hold_rank_0s_weights(broadcasting)
    _train_once(broadcasting, setup, loop)
    fallbacks = broadcasting.counts["weight_broadcast_fallbacks"]
    version = loop.run_until_complete(broadcasting.push_weights())
    assert broadcasting._broadcaster.generation == generation + 1
    assert broadcasting.counts["weight_broadcast_fallbacks"] == fallbacks
    assert [ray.get(e.actor.ping.remote()) for e in broadcasting.engines] == [version, version]
    _assert_engines_hold_rank_0s_weights(broadcasting)


def test_weight_sync_broadcast_is_refused_without_ray_naming_the_field():
    with pytest.raises(ValueError, match="backend.weight_sync=broadcast .* set backend.kind=ray"):
        load_config(None, [*SMALL, "backend.kind=local", "backend.weight_sync=broadcast"])
