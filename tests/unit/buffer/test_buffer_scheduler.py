"""Every kind: exactly once across save -> restore, the factory, and errors at the controller boundary."""

import ast
import dataclasses
import pathlib
import pickle
import random
import sys

import pytest
from buffer_sim import (PROMPT_IDS, build, check_exactly_once, drive, finished, keys, make_prompt_at, partial,
                        restorer)

import flashreinforce.buffer
from flashreinforce.buffer import SCHEDULERS, build_scheduler, scheduler_options
from flashreinforce.types import FORCED_VERSION, Trajectory, Verdict

KINDS = [
    ("sync", {}),
    ("april", {"over_provision": 1.5}),
    ("april", {"mask_offpolicy": True}),
    ("urb", {"buffer_size": 3}),
    ("stream", {"max_staleness": 1}),
    ("stream", {"max_staleness": 2, "stale_policy": "drop"}),
]


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in KINDS])
def test_save_restore_midway_continues_exactly_like_the_uninterrupted_run(kind, options):
    for seed in range(8):
        config = dict(batch_groups=3, group_size=2, **options)
        run = dict(steps=5, slots=2 + seed, seed=seed, preempt=0.1, hand_back=seed % 3 == 0)
        ticks = drive(build(kind, **config), **run).ticks
        pause_at = random.Random(seed).randint(2, ticks - 1)  # anywhere strictly inside the run
        run["pause_at"] = pause_at

        def rebuild(state, config=config):
            scheduler = restorer(kind, **config)(state)
            assert scheduler.state_dict() == state  # nothing lost or invented by the round trip
            return scheduler

        uninterrupted = drive(build(kind, **config), **run)
        restored = drive(build(kind, **config), rebuild=rebuild, **run)
        assert restored.paused_at == pause_at and restored.scheduler is not uninterrupted.scheduler
        check_exactly_once(restored)
        # the same keys trained at the same steps, the same tasks (and partials) handed out in the same order
        assert restored.summary() == uninterrupted.summary()
        assert restored.scheduler.ledger.state_dict() == uninterrupted.scheduler.ledger.state_dict()
        assert restored.scheduler.stats() == uninterrupted.scheduler.stats()


@pytest.mark.parametrize("kind, options", KINDS)
def test_repeated_prompts_get_fresh_sample_numbers(kind, options):
    trace = drive(build(kind, batch_groups=2, group_size=2, distinct=3, **options), steps=5, slots=4, seed=1,
                  preempt=0.1)
    check_exactly_once(trace)
    trained = [t.key for _, b in trace.batches for t in b]
    assert len(set(trained)) == len(trained) and {k.sample for k in trained} > {0, 1}  # epochs 2+ use 2, 3, ...


def test_factory_lists_kinds_and_rejects_bad_configuration():
    prompt_at = make_prompt_at()
    assert sorted(SCHEDULERS) == ["april", "stream", "sync", "urb"]
    assert build_scheduler("urb", prompt_at=prompt_at, batch_groups=2, group_size=1, buffer_size=2).buffer_size == 2
    cases = [
        (dict(kind="ppo"), "scheduler.kind='ppo' is unknown; choose one of"),
        (dict(kind="sync", buffer_size=2), r"no option\(s\) \['buffer_size'\]; its options are none"),
        (dict(kind="stream", over_provision=2.0), r"its options are \['max_staleness', 'stale_policy'\]"),
        (dict(kind="urb"), r"needs option\(s\) \['buffer_size'\]"),
        (dict(kind="urb", buffer_size=0), "buffer_size \\(N\\) must be an int >= 1"),
        (dict(kind="april", over_provision=0.5), "over_provision must be >= 1.0"),
        (dict(kind="stream", max_staleness=-1), "max_staleness \\(S\\) must be an int >= 0"),
        (dict(kind="stream", stale_policy="skip"), "stale_policy must be 'drop' or 'gate'"),
        (dict(kind="sync", batch_groups=0), "scheduler.batch_groups must be an int >= 1"),
        (dict(kind="sync", group_size=1.5), "scheduler.group_size must be an int >= 1"),
    ]
    for arguments, message in cases:
        arguments = {"prompt_at": prompt_at, "batch_groups": 2, "group_size": 1, **arguments}
        with pytest.raises(ValueError, match=message):
            build_scheduler(**arguments)


def test_controller_mistakes_are_value_errors_that_change_nothing():
    s = build("stream", batch_groups=1, group_size=2, max_staleness=1)
    a, b = s.admit(free_slots=2, version=0)
    with pytest.raises(ValueError, match="has group 5 but was admitted for data position 0"):
        s.on_finished(dataclasses.replace(finished(a), group=5))
    s.on_finished(finished(a))
    with pytest.raises(ValueError, match=r"on_finished: rollout RolloutKey\(prompt_id='p0', sample=0\) is not in"):
        s.on_finished(finished(a))
    with pytest.raises(ValueError, match="on_aborted: rollout .* is not in flight"):
        s.on_aborted(a, partial(a, (0,)))
    with pytest.raises(ValueError, match="came back with finish_reason 'stop'"):
        s.on_aborted(b, dataclasses.replace(partial(b, (0,)), finish_reason="stop"))
    s.on_finished(finished(b))
    assert keys(s.take_batch(0)) == [("p0", 0), ("p0", 1)]
    with pytest.raises(ValueError, match="a batch was already taken at version 0"):
        s.take_batch(0)
    with pytest.raises(ValueError, match="version must be the number of optimizer steps"):
        s.take_batch(-1)
    s.ledger.check()


def test_a_checkpoint_only_restores_into_the_same_scheduler_and_data():
    s = build("urb", batch_groups=2, group_size=1, buffer_size=2)
    task = s.admit(1, 0)[0]
    s.on_aborted(task, partial(task, (0, 0)))
    state = s.state_dict()
    with pytest.raises(ValueError, match="scheduler state is for scheduler.kind='urb', not 'sync'"):
        build("sync", batch_groups=2, group_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="has buffer_size=2 but this run has 3; resume with buffer_size=2"):
        build("urb", batch_groups=2, group_size=1, buffer_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="data position 0 held prompt 'p0' but the data now gives 'q0'"):
        other = build_scheduler("urb", prompt_at=lambda i: dataclasses.replace(make_prompt_at()(i), id=f"q{i}"),
                                batch_groups=2, group_size=1, buffer_size=2)
        other.load_state_dict(state)
    restored = restorer("urb", batch_groups=2, group_size=1, buffer_size=2)(state)
    (resumed,) = restored.admit(1, 0)
    assert resumed.key == task.key and resumed.partial == partial(task, (0, 0))


def test_in_flight_rollouts_stay_in_flight_across_a_checkpoint():
    s = build("stream", batch_groups=2, group_size=1, max_staleness=1, stale_policy="drop")
    p0, p1, p2 = s.admit(free_slots=3, version=0)
    s.on_finished(finished(p1))
    s.on_aborted(p2, partial(p2, (0,)))  # preempted before the save: parked inside the state
    state = pickle.loads(pickle.dumps(s.state_dict()))  # p0 is in flight; the controller keeps its partial
    restored = restorer("stream", batch_groups=2, group_size=1, max_staleness=1, stale_policy="drop")(state)
    assert restored.stats() == s.stats() and restored.stats()["buffer/in_flight"] == 1
    assert restored.book.in_flight == {p0.key: p0}
    (resumed, fresh) = restored.admit(free_slots=2, version=0)  # the parked one first, then new work
    assert resumed.key == p2.key and resumed.partial == partial(p2, (0,)) and fresh.key == ("p3", 0)
    restored.on_finished(finished(p0))  # the controller reports the task it re-submitted itself
    assert keys(restored.take_batch(0)) == [("p0", 0), ("p1", 0)]
    assert restored.ledger.summary() == {"scheduled": 4, "trained": 2, "outstanding": 2}


def test_scheduler_options_name_what_each_kind_accepts():
    assert scheduler_options("sync") == ()
    assert scheduler_options("april") == ("over_provision", "mask_offpolicy")
    assert scheduler_options("urb") == ("buffer_size",)
    assert scheduler_options("stream") == ("max_staleness", "stale_policy")
    with pytest.raises(ValueError, match="choose one of"):
        scheduler_options("ppo")


def test_buffer_imports_only_types_and_the_standard_library():
    package = pathlib.Path(flashreinforce.buffer.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name == "flashreinforce.types" or name.startswith(
                    "flashreinforce.buffer"), f"{path.name} imports {name}"


def test_a_groups_rollouts_share_the_version_its_first_one_was_admitted_at_even_across_a_checkpoint():
    s = build("stream", batch_groups=1, group_size=3, max_staleness=2)
    (first,) = s.admit(free_slots=1, version=0)
    state = pickle.loads(pickle.dumps(s.state_dict()))
    restored = restorer("stream", batch_groups=1, group_size=3, max_staleness=2)(state)
    assert restored.book.in_flight[first.key].group_version == 0
    later = restored.admit(free_slots=2, version=1)  # the siblings start after a weight push
    assert [t.key.prompt_id for t in later] == ["p0", "p0"]
    assert [t.admitted_version for t in later] == [1, 1] and [t.group_version for t in later] == [0, 0]
    (other,) = restored.admit(free_slots=1, version=1)
    assert other.key.prompt_id == "p1" and other.group_version == 1  # a new group starts at its own version


def test_a_checkpoint_written_before_group_versions_and_skipped_groups_were_kept_still_restores():
    s = build("urb", batch_groups=2, group_size=2, buffer_size=2)
    _first, second, _third = s.admit(free_slots=3, version=0)
    s.on_aborted(second, partial(second, (0,)))
    state = pickle.loads(pickle.dumps(s.state_dict()))
    del state["skipped"]
    for group in state["book"]["groups"]:
        del group["first_version"]
    restored = restorer("urb", batch_groups=2, group_size=2, buffer_size=2)(state)
    assert restored.skipped == 0
    resumed, fresh = restored.admit(free_slots=2, version=1)
    assert resumed.key == second.key and resumed.partial == partial(second, (0,))
    assert fresh.key == ("p1", 1) and fresh.group_version == 1  # its group's version is set at its next admission


def failed_reset(task) -> Trajectory:
    """What an episode whose environment reset failed comes back as: the bare prompt, nothing sampled."""
    return dataclasses.replace(finished(task), tokens=PROMPT_IDS, loss_mask=(0,) * len(PROMPT_IDS),
                               behavior_logprobs=(0.0,) * len(PROMPT_IDS),
                               policy_versions=(FORCED_VERSION,) * len(PROMPT_IDS), finish_reason="env_error",
                               verdict=Verdict(0.0, False, "env_error: ValueError: no layout"))


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in KINDS])
def test_a_group_with_a_rollout_whose_environment_failed_is_dropped_as_env_error_and_never_trained(kind, options):
    """The failed rollout sampled nothing, so it can never be trained; its group goes whole, like a filtered one
    (a group baseline over fewer rollouts than the group is not the loss the run asked for), and the run goes on."""
    s = build(kind, batch_groups=2, group_size=2, **options)
    batch = None
    for _ in range(20):
        for task in s.admit(free_slots=4, version=0):
            s.on_finished(failed_reset(task) if task.key == ("p1", 1) else finished(task))
        if (batch := s.take_batch(0)) is not None:
            break
    assert batch is not None, f"{kind}: no batch came after a failed environment; {s.stats()}"
    groups = sorted({t.group for t in batch})
    # urb trains exactly D_0 minus the dropped group; the others take the next prompt in its place
    assert groups == ([0] if kind == "urb" else [0, 2])
    assert all(t.num_policy_tokens > 0 for t in batch)
    assert {k: r for k, r in s.ledger.dropped().items()} == {("p1", 0): "env_error", ("p1", 1): "env_error"}
    assert s.stats()["buffer/dropped_env_error"] == 2
    s.ledger.check()


@pytest.mark.parametrize("kind, options", KINDS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in KINDS])
def test_a_later_stage_opens_data_where_its_first_step_would_be_and_trains_each_rollout_once(kind, options):
    """first_step=4 (a stage after 4 steps of others): the first prompts are those at positions 4B..., not the
    data's start again, and the run is exactly-once from there."""
    trace = drive(build(kind, batch_groups=3, group_size=2, first_step=4, **options), steps=3, slots=5, seed=1,
                  preempt=0.1, first_step=4)
    check_exactly_once(trace)
    first = min(int(task.key.prompt_id[1:]) for _, task in trace.admitted)
    assert first == 4 * 3, first
    assert [version for version, batch in trace.batches if batch][:1] == [4]
