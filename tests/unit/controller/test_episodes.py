"""EpisodeBackend: multi-turn episodes over a scripted engine and a real EnvPool (a user env in a worker).

The engine is scripted: each submit samples the request's next scripted turn (its text, then EOS) at once,
with log-probs and the policy version it holds; the environment echoes the action upper-cased and ends the
episode after 3 steps with reward 1. That makes every row's expected tokens, masks, log-probs and versions
computable here, turn by turn."""

from __future__ import annotations

import asyncio
import dataclasses
import textwrap

import pytest
from scripted_backend import FinishedQueue

from flashreinforce.buffer import build_scheduler
from flashreinforce.controller.episodes import (
    EpisodeBackend,
    EpisodeSettings,
    last_turn,
)
from flashreinforce.envs.pool import EnvPool
from flashreinforce.envs.protocol import EnvSpec
from flashreinforce.envs.single_turn import TextEpisodes, to_trajectory
from flashreinforce.models import build_char_tokenizer
from flashreinforce.types import (
    FORCED_VERSION,
    Generation,
    Prompt,
    SamplingParams,
    Verdict,
)

TOKENIZER = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:\n")
EOS = TOKENIZER.eos_token_id
PROMPT = Prompt("p0", "play:", "")

ENV_MODULE = textwrap.dedent('''
    import time


    class Echo:
        def reset(self, prompt, seed):
            if prompt.id == "broken":
                raise ValueError("no game for broken")
            self.n = 0
            return f"seed {seed}"

        def step(self, action):
            if action == "spin":
                while True:
                    pass
            if action == "nap":
                time.sleep(0.15)
            self.n += 1
            done = self.n >= 3
            return action.upper(), float(done), done, {"tool_call": action.startswith("run")}

        def close(self):
            pass
''')


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def logprob(turn: int, j: int) -> float:
    return -0.25 * (turn + 1) - 0.01 * j


class ScriptedBackend(FinishedQueue):
    """Samples each request's next scripted turn at once: its text then EOS, log-probs logprob(turn, j), the
    version it holds (bumped after every submit when `bump`), cut at max_new_tokens ("length")."""

    def __init__(self, script: dict[str, list[str]], *, bump: bool = True, version: int = 0) -> None:
        super().__init__()
        self.script, self.bump, self.version = script, bump, version
        self.submits: list[tuple[str, tuple[int, ...], Generation | None]] = []
        self.scored: list[tuple[str, Prompt]] = []

    @property
    def free_slots(self) -> int:
        return 8

    @property
    def in_flight(self) -> int:
        return len(self.done)

    def submit(self, rid, prompt_ids, params, prefix=None):
        self.submits.append((rid, tuple(prompt_ids), prefix))
        base = prefix or Generation(rid, tuple(prompt_ids), (), (), (), (), "abort", params)
        turn = base.token_ids.count(EOS)  # every scripted turn ends with EOS
        sampled = [*encode(self.script[rid][turn]), EOS]
        room = params.max_new_tokens - len(base.token_ids)
        finish = "stop" if len(sampled) <= room else "length"
        sampled = sampled[:room]
        n = len(sampled)
        self.finish(dataclasses.replace(
            base, token_ids=base.token_ids + tuple(sampled),
            behavior_logprobs=base.behavior_logprobs + tuple(logprob(turn, j) for j in range(n)),
            policy_versions=base.policy_versions + (self.version,) * n, loss_mask=base.loss_mask + (1,) * n,
            finish_reason=finish, episode=None))  # the engine does not keep the episode state
        self.version += self.bump

    async def score(self, items):
        self.scored.extend(items)
        return [Verdict(0.5, True, "ok") for _ in items]

    async def pause(self):
        done, self.done = self.done, []
        return [], done

    async def resume(self, partials):
        for partial in partials:
            self.submit(partial.request_id, partial.prompt_ids, partial.params, prefix=partial)

    async def abort(self, request_ids):
        return []

    def stats(self):
        return {}

    async def close(self):
        pass


@pytest.fixture(scope="module")
def env_spec(tmp_path_factory) -> EnvSpec:
    directory = tmp_path_factory.mktemp("envs")
    (directory / "echo_env.py").write_text(ENV_MODULE)
    return EnvSpec(kind="echo_env.py:Echo", base_dir=str(directory))


def params(max_new_tokens: int = 200, seed: int = 5) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, seed=seed)


async def collect(episodes: EpisodeBackend, n: int) -> list[Generation]:
    done: list[Generation] = []
    while len(done) < n:
        done += await asyncio.wait_for(episodes.finished(), 10)
    return done


def play(env_spec, script, settings, sampling=None, *, timeout=10.0, judge=False):
    """Run the scripted episodes to their end; returns the ended rows (by request id), verdicts, backend."""

    async def main():
        pool = EnvPool(env_spec, step_timeout_s=timeout, max_workers=1)
        await pool.start()
        try:
            backend = ScriptedBackend(script)
            episodes = EpisodeBackend(backend, TextEpisodes(TOKENIZER), pool=pool, settings=settings)
            for i, rid in enumerate(script):
                episodes.start(rid, PROMPT, sampling or params(seed=5 + i))
            rows = await collect(episodes, len(script))
            verdicts = await episodes.judge(rows) if judge else None
            assert episodes.in_flight == 0 and not pool.stats()["sessions"]  # every environment closed
            return {g.request_id: g for g in rows}, verdicts, backend, episodes
        finally:
            await pool.aclose()

    return asyncio.run(main())


def first_prompt(seed: int) -> list[int]:
    return encode(f"play:\nseed {seed}\n")  # the reset observation after a newline, then the suffix


def observation(action: str) -> list[int]:
    return encode(action.upper() + "\n")


# ---- the row of a finished episode ---------------------------------------------------------------------------

def test_a_finished_episode_is_prompt_then_sampled_turns_and_forced_observations(env_spec):
    script = {"r0": ["go", "look", "take"], "r1": ["up", "down", "left"]}
    rows, verdicts, backend, _ = play(env_spec, script, EpisodeSettings(max_turns=5, reward="env"), judge=True)

    for i, rid in enumerate(script):
        row, actions = rows[rid], script[rid]
        assert row.prompt_ids == tuple(first_prompt(5 + i))
        turns = [[*encode(a), EOS] for a in actions]
        expected, mask, logprobs = [], [], []
        for k, turn in enumerate(turns):
            expected += turn
            mask += [1] * len(turn)
            logprobs += [logprob(k, j) for j in range(len(turn))]
            if k < 2:  # no observation after the last turn: the environment said done
                expected += observation(actions[k])
                mask += [0] * len(observation(actions[k]))
                logprobs += [0.0] * len(observation(actions[k]))
        assert list(row.token_ids) == expected
        assert list(row.loss_mask) == mask
        assert list(row.behavior_logprobs) == logprobs
        sampled_versions = [v for v, m in zip(row.policy_versions, row.loss_mask) if m]
        assert all(v == FORCED_VERSION for v, m in zip(row.policy_versions, row.loss_mask) if not m)
        # the versions each turn was sampled at: one per turn, distinct (the backend bumps after each submit)
        per_turn = []
        for k, turn in enumerate(turns):
            start = sum(len(t) for t in turns[:k])
            per_turn.append(set(sampled_versions[start:start + len(turn)]))
        assert all(len(s) == 1 for s in per_turn) and len(set().union(*per_turn)) == 3
        assert row.finish_reason == "stop"
        state = row.episode
        assert state.actions == tuple(actions) and state.rewards == (0.0, 0.0, 1.0) and state.turns == 3
        assert state.end == "done" and state.pending is None and state.conversation is None
        assert last_turn(row) == tuple(turns[-1])

    # each continuation was submitted with the row so far as its prefix
    prefixes = [prefix for rid, _, prefix in backend.submits if rid == "r0"]
    assert len(prefixes) == 3 and prefixes[0].token_ids == ()  # the first turn continues the reset's prompt
    assert all(p.token_ids == rows["r0"].token_ids[:len(p.token_ids)] for p in prefixes)
    go, look = [*encode("go"), EOS, *observation("go")], [*encode("look"), EOS, *observation("look")]
    assert [len(p.token_ids) for p in prefixes] == [0, len(go), len(go) + len(look)]
    assert verdicts == [Verdict(1.0, True, "ok")] * 2  # env reward: the sum of the steps' rewards
    assert backend.scored == []  # reward=env: the verifier is not asked


def test_the_turn_budget_ends_an_episode_with_turns(env_spec):
    script = {"r0": ["go", "look", "take"]}
    rows, verdicts, _, episodes = play(env_spec, script, EpisodeSettings(max_turns=2, reward="env"), judge=True)
    row = rows["r0"]
    assert row.finish_reason == "turns" and row.episode.end == "turns"
    assert row.episode.actions == ("go", "look") and row.episode.rewards == (0.0, 0.0)
    assert list(row.token_ids) == [*encode("go"), EOS, *observation("go"), *encode("look"), EOS]
    assert verdicts == [Verdict(0.0, False, "failed")]
    assert episodes.counts == {"end/turns": 1}


@pytest.mark.parametrize("reward", ["verifier", "both"])
def test_a_turn_budget_that_ends_in_a_tool_call_leaves_no_answer_to_score(env_spec, reward):
    script = {"r0": ["go", "run x"], "r1": ["go", "look"]}
    rows, verdicts, backend, episodes = play(env_spec, script, EpisodeSettings(max_turns=2, reward=reward),
                                             judge=True)
    assert rows["r0"].finish_reason == rows["r1"].finish_reason == "turns"
    assert rows["r0"].episode.end == "turns_in_tool_call" and rows["r0"].episode.tool_calls == 1
    assert rows["r1"].episode.end == "turns"
    assert episodes.counts == {"end/turns_in_tool_call": 1, "end/turns": 1}
    assert [text for text, _ in backend.scored] == ["look"]  # the tool call is not read as an answer
    assert verdicts == [Verdict(0.0, False, "no_answer"), Verdict(0.5, True, "ok")]


def test_an_observation_that_does_not_fit_the_token_budget_ends_the_episode_with_length(env_spec):
    turn1 = [*encode("go"), EOS]
    budget = len(turn1) + len(observation("go"))  # no room left for a sampled token after the observation
    rows, *_ = play(env_spec, {"r0": ["go", "look", "take"]}, EpisodeSettings(max_turns=5), params(budget))
    row = rows["r0"]
    assert row.finish_reason == "length" and row.episode.end == "length"
    assert list(row.token_ids) == turn1  # the observation is not appended, not even in part
    assert row.episode.actions == ("go",)  # the environment did apply the action

    # one more token of budget: the observation fits, the next turn is cut by the engine ("length" too)
    rows, *_ = play(env_spec, {"r0": ["go", "look", "take"]}, EpisodeSettings(max_turns=5), params(budget + 1))
    row = rows["r0"]
    assert row.finish_reason == "length" and len(row.token_ids) == budget + 1
    assert list(row.token_ids) == [*turn1, *observation("go"), encode("l")[0]] and row.episode.actions == ("go",)


def test_max_context_counts_the_prompt_too(env_spec):
    turn1 = [*encode("go"), EOS]
    context = len(first_prompt(5)) + len(turn1) + len(observation("go"))
    rows, *_ = play(env_spec, {"r0": ["go", "look", "take"]}, EpisodeSettings(max_turns=5, max_context=context))
    assert rows["r0"].finish_reason == "length" and list(rows["r0"].token_ids) == turn1
    rows, *_ = play(env_spec, {"r0": ["go", "look", "take"]},
                    EpisodeSettings(max_turns=5, max_context=context + 100))
    assert rows["r0"].finish_reason == "stop"


def test_an_environment_timeout_ends_the_episode_with_env_error_and_scores_zero(env_spec):
    script = {"r0": ["go", "spin", "take"], "r1": ["up", "down", "left"]}
    rows, verdicts, backend, episodes = play(env_spec, script, EpisodeSettings(max_turns=5, reward="both"),
                                             timeout=0.3, judge=True)
    row = rows["r0"]
    assert row.finish_reason == "env_error" and row.episode.end == "env_timeout"
    assert row.episode.actions == ("go",) and row.episode.rewards == (0.0,)  # the spin was never applied
    assert list(row.token_ids) == [*encode("go"), EOS, *observation("go"), *encode("spin"), EOS]
    assert verdicts[0] == Verdict(0.0, False, "env_timeout")
    # the other episode, which lived on the killed worker, finished by replay
    assert rows["r1"].finish_reason == "stop" and rows["r1"].episode.actions == ("up", "down", "left")
    assert verdicts[1] == Verdict(1.5, True, "ok")  # both: the verifier's 0.5 plus the environment's 1
    assert [text for text, _ in backend.scored] == ["left"]  # the verifier reads the final turn only
    assert episodes.counts["end/env_timeout"] == 1


# ---- pause and resume ----------------------------------------------------------------------------------------

NAP_SCRIPT = {"r0": ["go", "nap", "take"]}


@pytest.fixture(scope="module")
def straight(env_spec) -> Generation:
    """The nap episode without a pause."""
    rows, *_ = play(env_spec, NAP_SCRIPT, EpisodeSettings(max_turns=5))
    return rows["r0"]


async def pause_during_the_nap(episodes: EpisodeBackend) -> list[Generation]:
    """Drive the episode until its second step (the nap) runs in the environment, then pause."""
    waiting = asyncio.ensure_future(episodes.finished())
    for _ in range(500):
        state = episodes._states.get("r0")
        if "r0" in episodes._turns and state is not None and state.actions == ("go",):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the nap step never started")
    waiting.cancel()  # as the loop does before a pause: a pending wait has taken nothing
    await asyncio.gather(waiting, return_exceptions=True)
    partials, done = await episodes.pause()
    assert done == []
    return partials


@pytest.mark.parametrize("step_ends_while_paused", [True, False])
def test_pause_during_an_environment_step_holds_the_action_and_resume_finishes_the_same_row(
        env_spec, straight, step_ends_while_paused):

    async def main():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            episodes = EpisodeBackend(ScriptedBackend(NAP_SCRIPT), TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5))
            episodes.start("r0", PROMPT, params())
            partials = await pause_during_the_nap(episodes)
            assert len(partials) == 1
            partial = partials[0]
            assert partial.finish_reason == "abort" and partial.episode.pending == "nap"
            assert partial.episode.actions == ("go",) and partial.episode.turns == 2
            assert list(partial.token_ids) == [*encode("go"), EOS, *observation("go"), *encode("nap"), EOS]
            assert episodes.in_flight == 0  # held, not in flight
            if step_ends_while_paused:  # its result waits for the resume
                await asyncio.sleep(0.25)
                assert episodes.in_flight == 0 and episodes._stepping["r0"].done()  # done, but not taken
                assert episodes._turns["r0"].token_ids == partial.token_ids  # nor continued
            else:  # resumed while the step still runs: its result continues the episode when it arrives
                assert not episodes._stepping["r0"].done()
            await episodes.resume(partials)
            (row,) = await collect(episodes, 1)
            return row, partial
        finally:
            await pool.aclose()

    row, _ = asyncio.run(main())
    assert row == straight
    assert row.episode.actions == ("go", "nap", "take") and row.finish_reason == "stop"


def test_a_restored_pending_episode_replays_its_actions_and_steps_again(env_spec, straight):

    async def first_process():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            backend = ScriptedBackend(NAP_SCRIPT)
            episodes = EpisodeBackend(backend, TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5))
            episodes.start("r0", PROMPT, params())
            (partial,) = await pause_during_the_nap(episodes)
            return partial, backend.version
        finally:
            await pool.aclose()

    async def second_process(partial, version):
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            episodes = EpisodeBackend(ScriptedBackend(NAP_SCRIPT, version=version), TextEpisodes(TOKENIZER),
                                      pool=pool, settings=EpisodeSettings(max_turns=5))
            episodes.restore("r0", PROMPT, params())
            await episodes.resume([partial])
            (row,) = await collect(episodes, 1)
            return row, dict(pool.counts)
        finally:
            await pool.aclose()

    partial, version = asyncio.run(first_process())
    row, counts = asyncio.run(second_process(partial, version))
    assert row == straight
    assert counts["replays"] == 1  # the reset and "go" replayed, then "nap" stepped


def test_lockstep_gives_the_same_rows(env_spec):
    script = {"r0": ["go", "look", "take"], "r1": ["up", "down", "left"]}
    free, *_ = play(env_spec, script, EpisodeSettings(max_turns=5))
    lockstep, *_ = play(env_spec, script, EpisodeSettings(max_turns=5, lockstep=True))
    assert {rid: g.token_ids for rid, g in free.items()} == {rid: g.token_ids for rid, g in lockstep.items()}
    assert all(g.finish_reason == "stop" for g in lockstep.values())


def test_abort_during_an_environment_step_returns_the_pending_partial_and_a_restart_finishes_it(env_spec, straight):
    async def main():
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            episodes = EpisodeBackend(ScriptedBackend(NAP_SCRIPT), TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5))
            episodes.start("r0", PROMPT, params())
            waiting = asyncio.ensure_future(episodes.finished())
            for _ in range(500):
                if "r0" in episodes._turns and episodes._states["r0"].actions == ("go",):
                    break
                await asyncio.sleep(0.005)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            (partial,) = await episodes.abort(["r0"])
            assert partial.episode.pending == "nap" and partial.finish_reason == "abort"
            assert not pool.has("r0") and episodes.in_flight == 0
            episodes.start("r0", PROMPT, partial.params, prefix=partial)  # at once, as a scheduler may
            (row,) = await collect(episodes, 1)
            await asyncio.sleep(0.01)
            return row, errors
        finally:
            await pool.aclose()

    row, errors = asyncio.run(main())
    assert errors == []  # no exception in a callback (the aborted step's task must not take the new one)
    assert row == straight


def test_a_turn_the_engine_finished_just_before_its_abort_comes_back_through_finished(env_spec):
    """The Backend contract the loop relies on (test_loop_in_flight): a cancelled rollout that finished before
    the abort reached the engine still comes back through finished(), and the loop discards it."""

    async def main():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            backend = ScriptedBackend({"r0": ["go", "look", "take"], "r1": ["up", "down", "left"]})
            episodes = EpisodeBackend(backend, TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5, reward="env"))
            episodes.start("r0", PROMPT, params())
            episodes.start("r1", PROMPT, params(seed=6))
            while len(backend.submits) < 2:  # both resets done: both first turns finished in the engine
                await asyncio.sleep(0.005)
            assert await episodes.abort(["r0"]) == []  # too late: the engine has nothing to abort
            assert not pool.has("r0")
            rows = {g.request_id: g for g in await collect(episodes, 2)}
            verdicts = await episodes.judge([rows["r0"]])
            return rows, verdicts
        finally:
            await pool.aclose()

    rows, verdicts = asyncio.run(main())
    late = rows["r0"]
    assert late.finish_reason == "abort" and list(late.token_ids) == [*encode("go"), EOS]
    assert late.episode.actions == () and verdicts[0].reward == 0.0 and not verdicts[0].passed
    assert rows["r1"].finish_reason == "stop" and rows["r1"].episode.actions == ("up", "down", "left")


def test_a_first_prompt_that_leaves_no_room_stops_the_run_naming_the_setting(env_spec):
    # raised where the reset's result arrives (a done-callback), it must still reach the caller of finished()
    with pytest.raises(ValueError, match="env.max_prompt_tokens"):
        play(env_spec, {"r0": ["go"]}, EpisodeSettings(max_turns=5, max_context=len(first_prompt(5))))


class DeadEngine(ScriptedBackend):
    """The engine's thread stopped on an error: every wait for finished work raises it."""

    async def finished(self):
        await asyncio.sleep(0)
        raise RuntimeError("the engine thread stopped on an error")


def test_an_engine_failure_stops_the_run_with_its_error(env_spec):
    # The failed engine wait is first seen by a done-callback, where a raise is only logged: finished() must
    # raise it, not wait again on an engine that holds nothing (the loop once spun on "Set of Tasks/Futures is
    # empty" for the rest of a vLLM run).
    async def main():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            episodes = EpisodeBackend(DeadEngine({"r0": ["go"]}), TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5))
            episodes.start("r0", PROMPT, params())
            await asyncio.wait_for(episodes.finished(), 5)
        finally:
            await pool.aclose()

    with pytest.raises(RuntimeError, match="engine thread stopped"):
        asyncio.run(main())


def test_an_episode_paused_during_its_reset_is_handed_back_by_abort_and_can_start_again(env_spec):
    """pause() returns such an episode as its first prompt, in no engine; an abort (april aborts everything at
    a push) must return that partial, or the rollout would be in flight with nothing accounting for it."""

    async def main():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            episodes = EpisodeBackend(ScriptedBackend({"r0": ["go", "look", "take"]}), TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5))
            episodes.start("r0", PROMPT, params())
            partials, done = await episodes.pause()  # the reset was still running
            assert [p.request_id for p in partials] == ["r0"] and not partials[0].token_ids and not done
            (aborted,) = await episodes.abort(["r0"])
            assert aborted.prompt_ids == partials[0].prompt_ids and episodes.in_flight == 0
            episodes.start("r0", PROMPT, params(), prefix=aborted)  # the scheduler resumes it later
            (row,) = await collect(episodes, 1)
            return row
        finally:
            await pool.aclose()

    row = asyncio.run(main())
    assert row.finish_reason == "stop" and row.episode.actions == ("go", "look", "take")


def test_a_raising_reset_ends_only_its_episode_and_the_scheduler_drops_it_as_env_error(env_spec):
    """Nothing was sampled, so the row can never be trained: it is recorded dropped ("env_error") in the
    exactly-once ledger and counted, never handed to the trainer, and the other episode trains as usual."""
    prompts = {"p0": PROMPT, "broken": dataclasses.replace(PROMPT, id="broken")}
    scheduler = build_scheduler("stream", prompt_at=lambda i: prompts[("p0", "broken")[i % 2]], batch_groups=1,
                                group_size=1, max_staleness=1)

    async def main():
        pool = EnvPool(env_spec, step_timeout_s=10, max_workers=1)
        await pool.start()
        try:
            backend = ScriptedBackend({"p0#0": ["go", "look", "take"], "broken#0": ["go"]})
            episodes = EpisodeBackend(backend, TextEpisodes(TOKENIZER), pool=pool,
                                      settings=EpisodeSettings(max_turns=5, reward="both"))
            tasks = {f"{t.key.prompt_id}#{t.key.sample}": t for t in scheduler.admit(free_slots=2, version=0)}
            assert sorted(tasks) == ["broken#0", "p0#0"]
            for rid, task in tasks.items():
                episodes.start(rid, task.prompt, params())
            rows = await collect(episodes, 2)
            verdicts = await episodes.judge(rows)
            assert not pool.stats()["sessions"]
            return rows, verdicts, backend, episodes
        finally:
            await pool.aclose()

    rows, verdicts, backend, episodes = asyncio.run(main())
    by_id = {row.request_id: (row, verdict) for row, verdict in zip(rows, verdicts)}
    broken, verdict = by_id["broken#0"]
    assert broken.finish_reason == "env_error" and broken.token_ids == () and not broken.loss_mask
    assert broken.episode.end == "env_error: ValueError: no game for broken"
    assert verdict == Verdict(0.0, False, "env_error: ValueError: no game for broken")
    assert [text for text, _ in backend.scored] == ["take"]  # the verifier is not asked about the broken one
    assert episodes.counts == {"end/env_error": 1, "end/done": 1}
    assert by_id["p0#0"][0].episode.actions == ("go", "look", "take")

    tasks = {f"{t.key.prompt_id}#{t.key.sample}": t for t in scheduler.book.in_flight.values()}
    for row, verdict in zip(rows, verdicts):
        task = tasks[row.request_id]
        scheduler.on_finished(to_trajectory(task.key, task.prompt, task.group, row, verdict))
    assert [t.key.prompt_id for t in scheduler.take_batch(0)] == ["p0"]
    assert scheduler.take_batch(1) is None  # the broken one never reaches the trainer
    assert scheduler.ledger.dropped() == {("broken", 0): "env_error"}
    assert scheduler.stats()["buffer/dropped_env_error"] == 1 and scheduler.stats()["buffer/outstanding"] == 0
