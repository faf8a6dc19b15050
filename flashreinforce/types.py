"""The shared vocabulary: small records that cross layer boundaries.

Nothing here imports torch. Per-token arrays are plain tuples so records pickle, compare and
serialize (checkpoints, Ray) without surprises. Every per-token array of a record is aligned with
its token array: index j describes token j.

Glossary, one word per idea:
  behavior_logprobs  log-prob the sampler assigned to a token, under the distribution it actually
                     sampled from (after temperature / top-k / top-p); never recomputed.
  policy_logprobs    the trainer's recomputation under the live weights.
  loss_mask          1 for a token the policy sampled and we train on; 0 for prompt, hint, tool or
                     environment text and padding.
  policy_version     number of optimizer steps taken by the weights that produced a token
                     (FORCED_VERSION for tokens nobody sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort", "turns", "env_error"]
"""stop: EOS or a stop string/token (for an episode: the environment said done); length: token budget or
context exhausted; abort: paused or cancelled before finishing (the record is then a partial rollout that
can be resumed); turns: an episode used its turn budget; env_error: its environment crashed, raised or
overran its deadline (the verdict's reason says which)."""

FORCED_VERSION = -1
"""policy_version of a token that was not sampled (prompt, hint, observation)."""

IMAGE_TOKEN = "<image>"
"""The placeholder of one image in prompt or observation text (verl's geometry3k layout); models/image_tokens.py
expands it, and envs check it without torch."""


@dataclass(frozen=True)
class Prompt:
    """One dataset item in the common RL format."""

    id: str
    """Stable unique id, e.g. "train/000042"; the exactly-once ledger is keyed by it."""
    prompt: str | tuple[dict[str, str], ...]
    """Plain text, or chat messages ({"role": ..., "content": ...}) for a chat template."""
    ground_truth: str
    """What the verifier compares against (reward_model.ground_truth)."""
    data_source: str = "default"
    """Which task or dataset the item comes from; evaluation reports per data_source."""
    reference_think: str | None = None
    """A worked solution's thinking, used by hint-based RL (AHRL)."""
    modality: str = "text"
    """Tag that selects per-modality trust-region bands (MISC)."""
    difficulty: float | None = None
    """Optional known difficulty (e.g. digit count); benchmarks use it to measure scheduler bias."""
    task: str = ""
    """The task of a mixture run it belongs to (its id then starts with "<task>/"); "" in a one-task run."""
    images: tuple[bytes, ...] = ()
    """Encoded images (PNG, JPEG, ...), one per IMAGE_TOKEN placeholder of the text, in order. Kept encoded: they
    are decoded when a request or a training row reads them, never stored as pixels."""


class RolloutKey(NamedTuple):
    """Identity of one scheduled rollout: the ledger's unit of exactly-once accounting."""

    prompt_id: str
    sample: int


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings of the rollout engine. Invalid values raise ValueError here."""

    max_new_tokens: int = 256
    """Budget for everything after the prompt (sampled and forced tokens together)."""
    temperature: float = 1.0
    """0 means greedy: the sampled distribution is a point mass on the argmax (behavior log-prob 0)."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""
    seed: int | None = None
    """Seeds this request's own random stream, so its tokens do not depend on its batch mates."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop on these tokens, in addition to the engine's EOS ids."""
    stop_strings: tuple[str, ...] = ()
    """Stop once the text sampled in the current turn contains one of these."""
    return_policy_logprobs: bool = False
    """Also return each sampled token's log-prob under the untruncated, temperature-1 policy."""

    def __post_init__(self) -> None:
        # Lists would make the record unhashable; tuples keep it frozen all the way down.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        problems = []
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            problems.append(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < float("inf")):
            problems.append(f"temperature={self.temperature!r} must be finite and >= 0 (0 = greedy)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k={self.top_k!r} must be an int >= 0 (0 disables it)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1 disables it)")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**64):
            problems.append(f"seed={self.seed!r} must be None or an int in [0, 2**64)")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids={self.stop_token_ids!r} must be non-negative ints")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            problems.append(f"stop_strings={self.stop_strings!r} must be non-empty strings")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))


NO_ROUTE = b"\xff\xff"
"""-1 as little-endian int16: no expert recorded for this (position, layer, slot)."""


@dataclass(frozen=True)
class Routes:
    """MoE routing of a token row, for rollout router replay (R3): for position j and MoE layer l, the top_k
    experts the engine's router chose for token j (-1 where none was recorded, e.g. the last token, which the
    engine never feeds). Little-endian int16 bytes in (positions, layers, top_k) order: compact, and like the
    tuples elsewhere they pickle and compare without numpy or torch."""

    layers: int
    top_k: int
    data: bytes

    @property
    def positions(self) -> int:
        return len(self.data) // (2 * self.layers * self.top_k)

    def extended(self, count: int) -> Routes:
        """These routes with `count` positions of no route appended (tokens the engine has not read yet)."""
        return Routes(self.layers, self.top_k, self.data + NO_ROUTE * (count * self.layers * self.top_k))


@dataclass(frozen=True)
class Generation:
    """What the engine hands back for one request: finished, or partial (finish_reason "abort").

    `token_ids` holds everything after the prompt: sampled tokens and forced (environment) tokens.
    A partial generation can be resumed: the engine continues after its last token and keeps the
    prefix, its behavior log-probs and its versions exactly.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    behavior_logprobs: tuple[float, ...]
    """0.0 for forced tokens."""
    policy_versions: tuple[int, ...]
    """FORCED_VERSION for forced tokens."""
    loss_mask: tuple[int, ...]
    """1 sampled, 0 forced."""
    finish_reason: FinishReason
    params: SamplingParams
    policy_logprobs: tuple[float, ...] | None = None
    """Untruncated temperature-1 log-probs, when params.return_policy_logprobs."""
    sampler_state: Any = None
    """Opaque engine state (e.g. the request's RNG state) that makes a resume continue the exact
    random stream of an uninterrupted run. Picklable."""
    episode: EpisodeState | None = None
    """A multi-turn episode's state (None for single-turn); the engine neither reads nor keeps it."""
    routes: Routes | None = None
    """An MoE engine's routing of prompt_ids + token_ids (one position per token); None for a dense model."""
    stale_context: bool = False
    """Some token was sampled while the KV cache held positions read by older weights (an in-flight weight
    update): its behavior log-prob is not what its own version's weights give for the whole row."""
    images: tuple[bytes, ...] = ()
    """Encoded images whose image tokens are in prompt_ids + token_ids, in placeholder order: the prompt's, then
    each environment observation's. A resume reads them all again."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        lengths = (len(self.behavior_logprobs), len(self.policy_versions), len(self.loss_mask))
        if self.policy_logprobs is not None:
            lengths += (len(self.policy_logprobs),)
        assert all(m == n for m in lengths), f"misaligned generation {self.request_id}: {n} tokens, arrays {lengths}"
        if self.routes is not None:
            total = len(self.prompt_ids) + n
            assert self.routes.positions == total, f"generation {self.request_id}: routes of " \
                f"{self.routes.positions} positions for {total} tokens"

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class EpisodeState:
    """What a multi-turn episode did so far, beyond its tokens: enough to rebuild its environment.

    Environments are deterministic in (prompt, seed, actions), so a checkpoint holds an in-flight episode as
    its token row plus this record, and a resume replays `actions` into a freshly reset environment.
    """

    seed: int
    """The seed of the environment's reset."""
    actions: tuple[str, ...] = ()
    """Actions the environment applied, in order; their observations are in the token row."""
    rewards: tuple[float, ...] = ()
    """The environment's reward for each applied action."""
    pending: str | None = None
    """An action sampled but not yet applied (the episode was paused during its environment step)."""
    tool_calls: int = 0
    """Steps whose info said tool_call (the Python tool counts its code runs)."""
    success: bool | None = None
    """The environment's last `info["success"]`, when it gave one."""
    conversation: tuple[dict[str, str], ...] | None = None
    """Chat episodes: the messages so far, what the chat template renders the next observation against."""
    end: str | None = None
    """Why a finished episode ended: done | turns | turns_in_tool_call (the last turn called a tool) | length |
    env_timeout | env_crash: ... | env_error: ..."""
    verdict: Verdict | None = None
    """A finished episode's judgement (environment reward, verifier, or both, per env.reward)."""
    calls: tuple[CallRecord, ...] = ()
    """An agent episode's model calls through the endpoint, in the order they were made (an in-flight call's
    generation is its partial): what a resume answers the re-run agent from."""
    segments: tuple[Generation, ...] = ()
    """A finished agent episode whose calls did not all extend one another token for token: the rows of its other
    segments (the episode's row is the one of its last call), trained beside it with the episode's reward."""

    @property
    def turns(self) -> int:
        return len(self.actions) + (self.pending is not None) + len(self.calls)


@dataclass(frozen=True)
class CallRecord:
    """One model call of an agent episode through the endpoint (endpoint/): what the engine was asked and what
    it sampled."""

    index: int
    """The call's number in its episode (0, 1, ...): it seeds the call's sampling and names its tool calls."""
    fingerprint: str
    """A digest of the call as rendered (the API, prompt ids and sampling): a resumed agent's request is answered
    from this record only when it renders to the same."""
    generation: Generation
    """The engine's row of the call: prompt_ids exactly as rendered, the sampled ids with their behavior log-probs
    and versions; finish_reason "abort" for a call a pause or a checkpoint caught in flight (its partial)."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one trajectory. Failures of user code land here, never as raises."""

    reward: float
    passed: bool
    reason: str = "ok"
    """ok | wrong | no_answer | timeout | crash: <message> | ..."""
    seconds: float = 0.0
    parts: tuple[tuple[str, float], ...] = ()
    """A combined verifier's (name, reward) per part (verifiers/registry.py sum_verifier); () otherwise."""
    signs: tuple[str, ...] = ()
    """What the hacking watch counts, seen while scoring whatever the reward (the code verifier: exited_early,
    base_exception, not_plain, unverified_asserts); metrics/groups.py reports their share per step and task."""


HACKING_SIGNS = ("exited_early", "base_exception", "not_plain", "unverified_asserts")
"""The signs the code verifier puts in Verdict.signs: the program exited (or killed itself or its harness) before
a test ended; a BaseException that is not an error (KeyboardInterrupt, a class of its own) ended one; a call returned
a value that is not plain data; a test outside the forms the verifier judges ran, trusting the program."""


NO_ANSWER = Verdict(reward=0.0, passed=False, reason="no_answer")
"""Nothing to score: no answer in the text, a think that never closes, an episode cut in a tool call."""


@dataclass(frozen=True)
class Trajectory:
    """One complete trajectory, all turns, as one token row ready to train on."""

    key: RolloutKey
    prompt: Prompt
    group: int
    """Index of the prompt in the fixed data order (= the U-RB data group it belongs to, times B)."""
    tokens: tuple[int, ...]
    """prompt + hint + all turns."""
    loss_mask: tuple[int, ...]
    behavior_logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    prompt_length: int
    """tokens[:prompt_length] is the prompt (including any hint)."""
    finish_reason: FinishReason
    verdict: Verdict
    hint_length: int = 0
    """How many of the prompt's tokens are an AHRL hint."""
    episode: EpisodeState | None = None
    """A multi-turn trajectory's actions, rewards and tool calls (None for single-turn)."""
    routes: Routes | None = None
    """The rollout's MoE routing of `tokens` (R3), None for a dense model."""
    stale_context: bool = False
    """See Generation.stale_context."""
    images: tuple[bytes, ...] = ()
    """See Generation.images: every image whose tokens are in `tokens`, the trainer's recompute reads them."""
    segments: tuple[Trajectory, ...] = ()
    """An agent episode of several segments (EpisodeState.segments): its other rows, each a trajectory of the same
    key, prompt, group and verdict. The trainer trains every row and counts the episode once in its baseline."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        lengths = (len(self.loss_mask), len(self.behavior_logprobs), len(self.policy_versions))
        if self.routes is not None:
            lengths += (self.routes.positions,)
        assert all(m == n for m in lengths), f"misaligned trajectory {self.key}: {n} tokens, arrays {lengths}"
        assert 0 < self.prompt_length <= n, f"trajectory {self.key}: prompt_length {self.prompt_length} of {n}"

    @property
    def reward(self) -> float:
        return self.verdict.reward

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def response_length(self) -> int:
        """Tokens after the prompt: the response's length, whether or not each token is trained (|y| of DAPO)."""
        return len(self.tokens) - self.prompt_length

    @property
    def oldest_version(self) -> int:
        """Version of the stalest sampled token of any of its rows (the one that bounds this trajectory's lag)."""
        versions = [v for row in self.rows() for v, m in zip(row.policy_versions, row.loss_mask) if m]
        return min(versions) if versions else FORCED_VERSION

    def rows(self) -> tuple[Trajectory, ...]:
        """The token rows to train: its segments', then its own (one row for every trajectory but a segmented agent
        episode's)."""
        if not self.segments:
            return (self,)
        return (*self.segments, replace(self, segments=()))
