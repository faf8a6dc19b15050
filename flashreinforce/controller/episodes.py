"""Episodes over a Backend: a request is a whole episode, model turns and environment steps on one row.

    start: [reset the environment] -> the engine generates a turn -> step the environment with the turn's
    text (in the env pool, with a deadline) -> append the observation as forced tokens -> the engine
    continues the same row -> ... -> done, or a turn / token budget ends it, or the environment fails
The loop, the schedulers and evaluation see an episode as one request in flight until it ends: `finished()`
hands back whole episodes only. Single-turn runs (no environment) are the one-turn case of the same path.

Pause acts on episodes: an episode in the engine comes back as the engine's partial; one whose environment
step is running comes back as its row so far with the action pending (the step goes on; its result is used
if the episode resumes in this process, and a restored episode replays its actions and steps it again). With
`lockstep` (deterministic runs) environment results are taken in a fixed order between engine steps, so a
run is a function of its seed; otherwise each result resubmits its episode the moment it arrives.

Images: the prompt's, then each observation's, ride on the row (Generation.images, in placeholder order), so each
turn's submit hands the engine every image of the row for its prefill, and partials and checkpoints keep them.

Agent episodes (a task of env.kind=agent) are the user's agent calling the model through the endpoint: their
calls are engine requests of their own (agent_episodes.py); this class routes them there and gives the loop the
same view of them as of any episode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from flashreinforce.controller.agent_episodes import AgentEpisodes, Settings
from flashreinforce.controller.backend import Backend
from flashreinforce.endpoint.service import Endpoint
from flashreinforce.envs.agents import AgentPool
from flashreinforce.envs.pool import EnvOutcome, EnvPool
from flashreinforce.envs.protocol import StepResult, observation_images
from flashreinforce.envs.single_turn import TextEpisodes
from flashreinforce.envs.turns import TurnRenderer
from flashreinforce.rollout.engine import append_forced_tokens
from flashreinforce.types import (
    NO_ANSWER,
    EpisodeState,
    FinishReason,
    Generation,
    Prompt,
    SamplingParams,
    Verdict,
)

RewardSource = Literal["env", "verifier", "both"]
CUT_IN_TOOL_CALL = "turns_in_tool_call"
"""How an episode ended whose last turn called a tool and used the last of env.max_turns."""
AGENT_FAILURES_IN_A_ROW = 100
"""Agent episodes that failed one after another, none ending well, that stop the run: an agent that always raises
(a bug in it, a template that cannot render its tools) would otherwise drop rollout after rollout forever."""


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int = 1
    reward: RewardSource = "verifier"
    """env: the environment's summed reward; verifier: the verifier on the final turn; both: their sum."""
    max_context: int | None = None
    """The engine's context: an observation that would not fit ends the episode ("length")."""
    lockstep: bool = False


@dataclass(frozen=True)
class TaskRoute:
    """How the episodes of one task run: single-turn (no renderer) or with its environment, and their budgets."""

    renderer: TurnRenderer | None = None
    """Multi-turn: renders the task's observations; None: single-turn (no environment), or an agent."""
    max_turns: int = 1
    reward: RewardSource = "verifier"
    agent: bool = False
    """The user's agent runs the episode through the endpoint (env.kind=agent)."""

    @property
    def multi_turn(self) -> bool:
        return self.renderer is not None or self.agent


@dataclass(frozen=True)
class AgentParts:
    """What agent episodes run on: the endpoint, the agent pool, and how agents reach the endpoint."""

    endpoint: Endpoint
    pool: AgentPool
    settings: Settings


def opening_row(request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                images: tuple[bytes, ...] = ()) -> Generation:
    """A request's row before its first token: submitted as a prefix, it starts the request like a fresh one."""
    return Generation(request_id=request_id, prompt_ids=tuple(prompt_ids), token_ids=(), behavior_logprobs=(),
                      policy_versions=(), loss_mask=(), finish_reason="abort", params=params, images=images)


def last_turn(generation: Generation) -> tuple[int, ...]:
    """The ids sampled after the last forced token: the turn that just ended."""
    forced = [j for j, m in enumerate(generation.loss_mask) if m == 0]
    return generation.token_ids[forced[-1] + 1 if forced else 0:]


class EpisodeBackend:
    """The Backend protocol at episode granularity (start/finished/pause/resume/abort), delegating the rest."""

    def __init__(self, inner: Backend, episodes: TextEpisodes, *, pool: EnvPool | None = None,
                 renderer: TurnRenderer | None = None, settings: EpisodeSettings = EpisodeSettings(),
                 tasks: Mapping[str, TaskRoute] | None = None, agents: AgentParts | None = None) -> None:
        """One task: `pool` and `renderer` (multi-turn) or neither, with settings' turns and reward. A mixture:
        `tasks` routes each prompt by its task (the pool holds every multi-turn task's environment). `agents`: what
        the tasks of agent routes run on."""
        self.inner, self.episodes, self.settings = inner, episodes, settings
        self.pool = pool
        if tasks is None:
            tasks = {"": TaskRoute(renderer or TurnRenderer(episodes.tokenizer, images=episodes.images)
                                   if pool is not None else None,
                                   settings.max_turns, settings.reward)}
        if pool is None and any(route.renderer is not None for route in tasks.values()):
            raise ValueError("a multi-turn task needs the environment pool")
        if agents is None and any(route.agent for route in tasks.values()):
            raise ValueError("an agent task needs the endpoint and the agent pool")
        self.tasks = dict(tasks)
        self._prompts: dict[str, Prompt] = {}
        self._params: dict[str, SamplingParams] = {}
        self._states: dict[str, EpisodeState] = {}
        """Each live episode's state; attached to the engine's rows as they come back (it does not keep it)."""
        self._stepping: dict[str, asyncio.Task] = {}
        """Resets and steps running in the env pool, by request id."""
        self._turns: dict[str, Generation] = {}
        """The row of an episode whose environment step is running (its last turn is the action)."""
        self._held: set[str] = set()
        """Paused while their step ran: its result waits for a resume."""
        self._completed: list[Generation] = []
        self._engine_wait: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._rendered: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self._pausing = False
        """While pause() runs, an environment result waits (held as a pending action), never resubmitting its
        episode to the engine behind the pause's back."""
        self._first_prompts: dict[str, Generation] = {}
        """Paused episodes whose reset finished but which never reached the engine: abort() hands them back."""
        self._failure: Exception | None = None
        """An error raised where the loop could not see it (an environment result's callback)."""
        self.counts: dict[str, int] = {}
        self._agent_failures = 0
        """Agent episodes failed in a row (AGENT_FAILURES_IN_A_ROW)."""
        self.agents = None if agents is None else AgentEpisodes(
            inner, agents.endpoint, agents.pool, agents.settings, on_end=self._agent_ended,
            reward_needed=lambda rid: self.route(rid).reward == "env", wake=self._wake.set, fail=self._fail)

    # ---- delegated --------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:  # train, push_weights, state_dict, save_model, ...
        return getattr(self.inner, name)

    @property
    def _live_env_calls(self) -> int:
        """Episodes in flight at an environment call (not those a pause holds): each keeps its engine slot."""
        return len(set(self._stepping) - self._held)

    @property
    def _outside_engine(self) -> int:
        """Episodes in flight outside the engine: at an environment call, or an agent's own work."""
        return self._live_env_calls + (self.agents.outside_engine if self.agents is not None else 0)

    @property
    def free_slots(self) -> int:
        return max(0, self.inner.free_slots - self._outside_engine)

    @property
    def in_flight(self) -> int:
        wait = self._engine_wait
        taken = len(wait.result()) if wait is not None and wait.done() and not wait.cancelled() \
            and wait.exception() is None else 0  # finished in the engine, not yet collected
        return self.inner.in_flight + taken + self._outside_engine + len(self._completed)

    def stats(self) -> dict[str, float]:
        metrics = self.inner.stats()
        if self.pool is not None:
            metrics.update({f"env/{k}": v for k, v in self.pool.stats().items()})
        if self.pool is not None or self.agents is not None:
            metrics.update({f"episode/{k}": float(v) for k, v in self.counts.items()})
        if self.agents is not None:
            metrics.update(self.agents.stats())
        return metrics

    def route(self, rid: str) -> TaskRoute:
        """The route of a started episode's task."""
        return self.tasks[self._prompts[rid].task]

    async def close(self) -> None:
        for task in self._stepping.values():
            task.cancel()
        if self.agents is not None:
            await self.agents.close()
        await self.inner.close()

    # ---- starting ---------------------------------------------------------------------------------------

    def start(self, request_id: str, prompt: Prompt, params: SamplingParams, hint_ids: Sequence[int] = (),
              prefix: Generation | None = None) -> None:
        """Begin an episode, or continue `prefix` (a partial of it, from a pause, an abort or a checkpoint)."""
        if prompt.task not in self.tasks:
            raise KeyError(f"prompt {prompt.id} is of task {prompt.task!r}, which this backend does not run "
                           f"(its tasks: {sorted(self.tasks)})")
        self._prompts[request_id], self._params[request_id] = prompt, params
        self._wake.set()  # a finished() waiting with nothing in the engine must see the new work
        if self.tasks[prompt.task].agent:
            self.agents.start(request_id, prompt, params, prefix)
        elif prefix is not None:
            self._continue(prefix)
        elif not self.tasks[prompt.task].multi_turn:
            ids = self._single_turn_ids(prompt, tuple(hint_ids))
            # Images travel with the request's row (Generation.images), so that every resume brings them back.
            opening = opening_row(request_id, ids, params, prompt.images) if prompt.images else None
            self.inner.submit(request_id, ids, params, prefix=opening)
        else:
            seed = params.seed if params.seed is not None else 0
            self._run_env(request_id, self._reset(request_id, prompt, seed, tuple(hint_ids)))

    def _single_turn_ids(self, prompt: Prompt, hint_ids: tuple[int, ...]) -> list[int]:
        """Rendered once per (prompt, hint): an evaluation starts k samples of each prompt, and a group's G
        rollouts share one prompt (bounded: cleared at 4096 entries)."""
        key = (prompt.id, hint_ids)
        if key not in self._rendered:
            if len(self._rendered) >= 4096:
                self._rendered.clear()
            self._rendered[key] = self.episodes.prompt_ids(prompt, hint_ids)
        return self._rendered[key]

    async def _reset(self, rid: str, prompt: Prompt, seed: int, hint_ids: tuple[int, ...]) -> Generation | EnvOutcome:
        outcome = await self.pool.reset(rid, prompt, seed)
        if outcome.failure is not None:
            return outcome
        ids, conversation = self.tasks[prompt.task].renderer.first_prompt(prompt, outcome.value)
        self._states[rid] = EpisodeState(seed=seed, conversation=conversation)
        # The prompt's images, then the reset observation's: they travel with the row (Generation.images), so the
        # engine reads them at every turn's prefill and a resume brings them back.
        images = (*prompt.images, *observation_images(outcome.value))
        return replace(opening_row(rid, (*ids, *hint_ids), self._params[rid], images), episode=self._states[rid])

    def _continue(self, partial: Generation) -> None:
        rid, state = partial.request_id, partial.episode
        self._first_prompts.pop(rid, None)
        if state is not None:
            self._states[rid] = replace(state, pending=None)
            self._reopen(partial)
        if state is not None and state.pending is not None:
            self._held.discard(rid)
            if rid not in self._stepping:  # restored: step it again (replaying the actions first)
                self._step(rid, replace(partial, episode=replace(state, pending=None)), state.pending)
            elif self._stepping[rid].done() and not self.settings.lockstep:
                self._take_step(rid)
            return
        self.inner.submit(rid, partial.prompt_ids, partial.params, prefix=partial)

    # ---- environment steps ------------------------------------------------------------------------------

    def _run_env(self, rid: str, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._stepping[rid] = task
        if not self.settings.lockstep:  # resubmit the moment the result arrives, while this task is still the
            # episode's (after an abort, a restarted episode's own step may be running)
            task.add_done_callback(lambda done, rid=rid: self._take_step_soon(rid) if self._stepping.get(rid) is done
                                   and rid not in self._held and not self._pausing else None)

    def _fail(self, error: Exception) -> None:
        """An error raised where the loop could not see it: finished() raises it, which stops the run."""
        self._failure = error
        self._wake.set()

    def _take_step_soon(self, rid: str) -> None:
        """_take_step from a done-callback, where a raise would be logged and lost: finished() re-raises it."""
        try:
            self._take_step(rid)
        except Exception as error:  # noqa: BLE001 - handed to the loop, which stops the run with it
            self._failure = error
            self._wake.set()

    def _step(self, rid: str, row: Generation, action: str) -> None:
        self._turns[rid] = row
        self._run_env(rid, self.pool.step(rid, action))

    def _take_step(self, rid: str) -> None:
        """An environment call of `rid` returned: continue the episode, or end it."""
        task = self._stepping.pop(rid)
        if task.cancelled():
            return
        result = task.result()
        row = self._turns.pop(rid, None)
        if isinstance(result, Generation):  # a reset: the first turn's prompt
            limit = self.settings.max_context
            if limit is not None and len(result.prompt_ids) >= limit:
                raise ValueError(f"episode {rid}: its first prompt (the task and the reset observation) is "
                                 f"{len(result.prompt_ids)} tokens and leaves no room in the context of {limit}; "
                                 "raise env.max_prompt_tokens (or shorten the observation)")
            self.inner.submit(rid, result.prompt_ids, result.params, prefix=result)
        elif result.failure is not None:
            self._end(row or self._empty(rid), result.failure.split(":", 1)[0] if row else "env_error",
                      "env_error", result.failure)
        else:
            self._observe(rid, row, result.value)
        self._wake.set()

    def _observe(self, rid: str, row: Generation, step: StepResult) -> None:
        route, state = self.route(rid), row.episode
        state = replace(state, actions=(*state.actions, route.renderer.action_text(last_turn(row))),
                        rewards=(*state.rewards, float(step.reward)),
                        tool_calls=state.tool_calls + bool(step.info.get("tool_call")),
                        success=step.info.get("success", state.success))
        row = replace(row, episode=state)
        self._states[rid] = state
        if step.done:
            return self._end(row, "done", "stop")
        if len(state.actions) >= route.max_turns:
            # A final turn that called a tool is not an answer: the model never saw the tool's output.
            return self._end(row, CUT_IN_TOOL_CALL if step.info.get("tool_call") else "turns", "turns")
        forced, conversation = route.renderer.observation_ids(state.conversation, last_turn(row), step.observation)
        length = len(row.prompt_ids) + len(row.token_ids) + len(forced)
        if (len(row.token_ids) + len(forced) >= row.params.max_new_tokens
                or (self.settings.max_context is not None and length >= self.settings.max_context)):
            return self._end(row, "length", "length")
        self._states[rid] = replace(state, conversation=conversation)
        row = append_forced_tokens(replace(row, episode=self._states[rid]), forced)
        row = replace(row, images=(*row.images, *observation_images(step.observation)))  # in placeholder order
        self.inner.submit(rid, row.prompt_ids, row.params, prefix=row)

    def _empty(self, rid: str) -> Generation:
        """A row for an episode whose reset failed: the bare prompt, nothing sampled. It can never be trained:
        the scheduler records its group dropped ("env_error") and the run goes on (GroupBook.keep)."""
        params, prompt = self._params[rid], self._prompts[rid]
        return Generation(request_id=rid, prompt_ids=tuple(self.episodes.prompt_ids(prompt)),
                          token_ids=(), behavior_logprobs=(), policy_versions=(), loss_mask=(),
                          finish_reason="env_error", params=params, images=prompt.images,
                          episode=EpisodeState(seed=params.seed if params.seed is not None else 0))

    def _end(self, row: Generation, end: str, finish: FinishReason, detail: str | None = None) -> None:
        self.counts[f"end/{end}"] = self.counts.get(f"end/{end}", 0) + 1
        if self.pool is not None and not self.route(row.request_id).agent:
            self.pool.close(row.request_id)
        state = replace(row.episode, end=detail or end) if row.episode is not None else None
        self._states.pop(row.request_id, None)
        self._completed.append(replace(row, finish_reason=finish, episode=state))

    def _agent_ended(self, row: Generation, end: str) -> None:
        """An agent episode ended: counted by why (done, agent_error, agent_timeout, agent_no_calls, ...)."""
        self._end(row, end.split(":", 1)[0], row.finish_reason, end)
        segments = len(row.episode.segments) + bool(row.token_ids)
        self.counts["segments"] = self.counts.get("segments", 0) + segments
        self.counts["multi_segment"] = self.counts.get("multi_segment", 0) + (segments > 1)
        self._agent_failures = self._agent_failures + 1 if end.startswith("agent_") else 0
        if self._agent_failures >= AGENT_FAILURES_IN_A_ROW:
            self._failure = RuntimeError(
                f"the last {self._agent_failures} agent episodes all failed, the last one with {end}: the run cannot "
                "train. Fix the agent (env.agent), or what it asks of the endpoint (episode/end/* and endpoint/errors/* "
                "in metrics.jsonl count the reasons)")
        self._wake.set()

    def _on_turns(self, generations: Sequence[Generation]) -> None:
        """Turns the engine finished: single-turn rows are done; an episode's turn goes to its environment, an
        agent's call to its request."""
        for generation in generations:
            rid = generation.request_id
            if self.agents is not None and self.agents.owns(rid):
                self.agents.on_generation(generation)
                continue
            if rid not in self._prompts or not self.route(rid).multi_turn:  # single-turn, or aborted and forgotten
                self._completed.append(generation)
                continue
            if rid not in self._states:  # aborted after the engine finished this turn: it comes back as ended
                # (the Backend contract; the loop knows it was cancelled and discards it)
                seed = generation.params.seed if generation.params.seed is not None else 0
                self._end(replace(generation, episode=EpisodeState(seed=seed)), "aborted", "abort")
                continue
            row = replace(generation, episode=self._states[rid])
            if generation.finish_reason == "length":  # the budget ran out inside the turn
                self._end(row, "length", "length")
            else:
                self._step(rid, row, self.route(rid).renderer.action_text(last_turn(row)))

    # ---- the loop's view -------------------------------------------------------------------------------

    async def finished(self) -> list[Generation]:
        """Wait until at least one episode ended; return every ended one."""
        while not self._completed:
            if self._failure is not None:
                raise self._failure
            if self.settings.lockstep and set(self._stepping) - self._held:
                await self._settle_steps()
                continue
            if self.settings.lockstep and self.agents is not None and self.agents.due():
                await self.agents.settle()
                continue
            self._wake.clear()
            waiters = [asyncio.ensure_future(self._wake.wait())]
            if self._engine_wait is None and self.inner.in_flight:
                self._engine_wait = asyncio.ensure_future(self.inner.finished())
                self._engine_wait.add_done_callback(self._collect)
            if self._engine_wait is not None:
                waiters.append(self._engine_wait)
            # else: nothing in the engine; an environment step's result (or a start) will wake us
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiters[0].cancel()
            if self._engine_wait is not None and self._engine_wait.done():
                self._collect(self._engine_wait)
            elif self._engine_wait is not None:  # woken by a resubmission: wait again on a fresh snapshot
                await self._stop_engine_wait()
        done, self._completed = self._completed, []
        return done

    async def _settle_steps(self) -> None:
        """Lockstep: every running environment call finishes, and is taken in the order it started."""
        pending = [rid for rid in self._stepping if rid not in self._held]
        if not pending:
            return
        await asyncio.wait([self._stepping[rid] for rid in pending])
        for rid in pending:
            self._take_step(rid)

    def _collect(self, wait: asyncio.Task) -> None:
        """Take the turns a finished engine wait returned (once). It runs as a done-callback too, where a raise
        would be logged and lost: an engine failure is kept for finished() to raise, which stops the run."""
        if wait is not self._engine_wait or not wait.done() or wait.cancelled():
            return
        self._engine_wait = None
        try:
            self._on_turns(wait.result())
        except Exception as error:  # noqa: BLE001 - handed to the loop, which stops the run with it
            self._failure = error
        self._wake.set()

    async def _stop_engine_wait(self) -> None:
        """Cancel the engine wait (cancel-safe: a cancelled wait has taken nothing)."""
        wait = self._engine_wait
        if wait is None:
            return
        if wait.done():
            self._collect(wait)
            return
        self._engine_wait = None
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)

    async def pause(self) -> tuple[list[Generation], list[Generation]]:
        """Partials of every episode in flight (environment steps held as pending actions, agent episodes as their
        records) and ended ones."""
        self._pausing = True
        try:
            partials, done = await self._pause()
        finally:
            self._pausing = False
        self._first_prompts.update((p.request_id, p) for p in partials if not p.token_ids
                                   and p.request_id not in self._stepping and not self.route(p.request_id).agent)
        return partials, done

    async def _pause(self) -> tuple[list[Generation], list[Generation]]:
        await self._stop_engine_wait()
        first_prompts = [rid for rid in self._stepping if rid not in self._turns and rid not in self._held]
        self._held.update(first_prompts)
        partials = []
        for rid in first_prompts:  # a reset is short: let it finish and hold the first prompt as a partial
            await asyncio.wait([self._stepping[rid]])
            self._held.discard(rid)
            result = self._stepping.pop(rid).result()
            if isinstance(result, Generation):
                partials.append(result)
            else:
                self._end(self._empty(rid), "env_error", "env_error", result.failure)
        engine_partials, finished = await self.inner.pause()
        self._on_turns(finished)
        if self.agents is not None:
            calls = [p for p in engine_partials if self.agents.owns(p.request_id)]
            engine_partials = [p for p in engine_partials if not self.agents.owns(p.request_id)]
            partials += self.agents.pause(calls)
        partials += [replace(p, episode=self._states.get(p.request_id)) for p in engine_partials]
        for rid in [r for r in self._stepping if r not in self._held]:
            self._held.add(rid)
            row = self._turns[rid]
            action = self.route(rid).renderer.action_text(last_turn(row))
            partials.append(replace(row, finish_reason="abort", episode=replace(self._states[rid], pending=action)))
        done, self._completed = self._completed, []
        return partials, done

    async def resume(self, partials: Sequence[Generation]) -> None:
        """Continue paused episodes under the current weights, in the given order (an agent episode paused here
        goes on; one restored from a checkpoint re-runs its agent over its record)."""
        for partial in partials:
            if partial.request_id not in self._prompts:
                raise KeyError(f"resume: {partial.request_id} was not started here; restore() it with its prompt")
        agent = [p for p in partials if self.route(p.request_id).agent]
        partials = [p for p in partials if not self.route(p.request_id).agent]
        engine = [p for p in partials if (p.episode is None or p.episode.pending is None)
                  and p.request_id not in self._stepping]
        for partial in partials:
            if partial.episode is not None:
                self._states[partial.request_id] = replace(partial.episode, pending=None)
                self._reopen(partial)
        for partial in engine:
            self._first_prompts.pop(partial.request_id, None)
        await self.inner.resume(engine)
        if self.agents is not None:
            restored = [p for p in agent if not self.agents.is_live(p.request_id)]  # from a checkpoint or an abort
            await self.agents.resume()
            for partial in restored:
                self.agents.start(partial.request_id, self._prompts[partial.request_id], partial.params, partial)
        self._wake.set()
        for partial in partials:
            if partial not in engine:
                self._continue(partial)

    def restore(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        """Before resume() of a checkpoint's partial: what the episode is about."""
        self._prompts[request_id], self._params[request_id] = prompt, params

    def _reopen(self, partial: Generation) -> None:
        """An episode whose environment this pool no longer holds (restored, or aborted earlier) replays it."""
        rid = partial.request_id
        if rid not in self._stepping and not self.pool.has(rid):
            self.pool.attach(rid, self._prompts[rid], partial.episode.seed, partial.episode.actions)

    async def abort(self, request_ids: Sequence[str]) -> list[Generation]:
        """Cancel episodes; their partials come back, their environments are closed (a later start replays)."""
        agent = {rid: await self.agents.abort(rid) for rid in request_ids
                 if self.agents is not None and self.agents.is_live(rid)}
        others = [rid for rid in request_ids if rid not in agent]
        partials = {**agent, **{p.request_id: p for p in await self._abort(others)}}
        return [partials[rid] for rid in request_ids if rid in partials]

    async def _abort(self, request_ids: Sequence[str]) -> list[Generation]:
        resets = [rid for rid in request_ids if rid in self._stepping and rid not in self._turns]
        self._held.update(resets)
        for rid in resets:  # a reset is short: let it finish, so the partial holds the first prompt
            await asyncio.wait([self._stepping[rid]])
        stepping = [rid for rid in request_ids if rid in self._stepping]
        partials = {p.request_id: replace(p, episode=self._states.get(p.request_id))
                    for p in await self.inner.abort([r for r in request_ids if r not in self._stepping])}
        for rid in stepping:
            task, row = self._stepping.pop(rid), self._turns.pop(rid, None)
            self._held.discard(rid)
            if row is not None:
                task.cancel()
            if row is not None:
                action = self.route(rid).renderer.action_text(last_turn(row))
                partials[rid] = replace(row, finish_reason="abort", episode=replace(self._states[rid], pending=action))
            elif not task.cancelled() and isinstance(task.result(), Generation):
                partials[rid] = task.result()
            else:  # the reset failed: the episode ends here, reported as ended
                self._end(self._empty(rid), "env_error", "env_error", task.result().failure)
        for rid in request_ids:
            if rid not in partials and rid in self._first_prompts:  # paused after its reset, never in the engine
                partials[rid] = self._first_prompts[rid]
            self._first_prompts.pop(rid, None)
            if self.pool is not None:
                self.pool.close(rid)
            self._states.pop(rid, None)
        return [partials[rid] for rid in request_ids if rid in partials]

    # ---- verdicts ----------------------------------------------------------------------------------------

    def answer_text(self, generation: Generation) -> str:
        """The text a verifier scores: the completion, or an episode's final turn."""
        route = self.route(generation.request_id)
        if route.agent:
            return self.agents.answers.get(generation.request_id, "")
        if not route.multi_turn:
            return self.episodes.completion_text(generation)
        return route.renderer.action_text(last_turn(generation))

    async def judge(self, generations: Sequence[Generation]) -> list[Verdict]:
        """Each ended episode's verdict: the verifier on its final turn, the environment's reward, or both (per
        its task); the verifier pool scores each row with its task's verifier."""
        routes = [self.route(g.request_id) for g in generations]
        texts = [self.answer_text(g) for g in generations]
        prompts = [self._prompts.pop(g.request_id) for g in generations]
        for g in generations:
            self._params.pop(g.request_id, None)
            if self.agents is not None:
                self.agents.answers.pop(g.request_id, None)
        asks = [i for i, (g, route) in enumerate(zip(generations, routes))
                if not route.multi_turn or (route.reward != "env" and g.finish_reason != "env_error"
                                            and g.episode.end != CUT_IN_TOOL_CALL)]
        scored = dict(zip(asks, await self.inner.score([(texts[i], prompts[i]) for i in asks])))
        return [episode_verdict(g.episode, scored.get(i), route.reward) if route.multi_turn else scored[i]
                for i, (g, route) in enumerate(zip(generations, routes))]


def episode_verdict(state: EpisodeState, verifier: Verdict | None, source: RewardSource) -> Verdict:
    """Combine the environment's rewards and the verifier's verdict per env.reward; a failed environment
    scores 0 with its reason (env_timeout, env_crash: ..., env_error: ..., and an agent's agent_error: ...,
    agent_timeout, agent_crash: ...), and an episode the turn budget cut
    in a tool call has no answer for the verifier (0, no_answer): a verifier that falls back to the last number
    of the turn would otherwise reward printing the answer's variable and running out of turns."""
    if state.end is not None and state.end.startswith(("env_", "agent_")):
        return Verdict(reward=0.0, passed=False, reason=state.end)
    if state.end == CUT_IN_TOOL_CALL and source != "env":
        verifier = NO_ANSWER
    env_reward = sum(state.rewards)
    env_passed = state.success if state.success is not None else env_reward > 0
    if source == "env" or verifier is None:
        return Verdict(reward=env_reward, passed=bool(env_passed), reason="ok" if env_passed else "failed")
    if source == "verifier":
        return verifier
    return replace(verifier, reward=verifier.reward + env_reward, passed=verifier.passed and state.success is not False)
