"""An agent episode's calls as token rows: stitched where a call extends an earlier one token for token.

Pure functions over CallRecords. A call's prompt that starts with a segment's whole row (its first prompt, then
every sampled and forced token since) continues that segment: the new part of the prompt is appended as forced
tokens (loss_mask 0, version -1) and the call's sampled tokens after it. Any other call opens a new segment.

    call 0: prompt [s u]                 -> segment A: [s u | a0]
    call 1: prompt [s u a0 t]            -> segment A: [s u | a0 (t) a1]        (t forced)
    call 2: prompt [s u' ...]            -> segment B: [s u' ... | b2]          (the agent rewrote its history)

The sampled ids in a row are the engine's own: nothing here (or in the endpoint) decodes and re-encodes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from flashreinforce.rollout.engine import append_forced_tokens
from flashreinforce.types import CallRecord, Generation, SamplingParams


def fingerprint(api: str, prompt_ids: Sequence[int], params: SamplingParams) -> str:
    """What identifies a call for replay: the API, the rendered prompt ids and the engine's sampling of it."""
    text = f"{api}|{','.join(map(str, prompt_ids))}|{params!r}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def row_of(generation: Generation) -> tuple[int, ...]:
    """Everything the engine read or wrote for a row: its prompt, then its tokens."""
    return (*generation.prompt_ids, *generation.token_ids)


def extends(prompt_ids: Sequence[int], row: Sequence[int]) -> bool:
    """`prompt_ids` starts with the whole of `row` (a completion asked to go on may add nothing to it)."""
    return len(prompt_ids) >= len(row) and tuple(prompt_ids[: len(row)]) == tuple(row)


def continue_segment(segment: Generation, call: Generation) -> Generation:
    """`segment` continued by `call`, whose prompt extends the segment's row: the prompt's new tokens forced, then
    the call's sampled ones. The call re-read the whole row, so its MoE routes (when recorded) are the row's."""
    forced = call.prompt_ids[len(segment.prompt_ids) + len(segment.token_ids):]
    row = append_forced_tokens(segment, forced)
    return replace(
        row,
        token_ids=row.token_ids + call.token_ids,
        behavior_logprobs=row.behavior_logprobs + call.behavior_logprobs,
        policy_versions=row.policy_versions + call.policy_versions,
        loss_mask=row.loss_mask + call.loss_mask,
        policy_logprobs=None if row.policy_logprobs is None or call.policy_logprobs is None
        else row.policy_logprobs + call.policy_logprobs,
        finish_reason=call.finish_reason,
        routes=call.routes,
        stale_context=row.stale_context or call.stale_context,
    )


def stitch(calls: Sequence[CallRecord]) -> tuple[list[Generation], int]:
    """The episode's segments in the order they opened, and the index of the one its last call is in. A call
    continues the latest segment whose row its prompt extends; a call with nothing sampled (an abandoned one) is
    left out."""
    segments: list[Generation] = []
    last = 0
    for call in sorted(calls, key=lambda c: c.index):
        generation = call.generation
        if not generation.token_ids:
            continue
        for k in reversed(range(len(segments))):
            if extends(generation.prompt_ids, row_of(segments[k])):
                segments[k] = continue_segment(segments[k], generation)
                last = k
                break
        else:
            segments.append(replace(generation, request_id=generation.request_id.rsplit("@", 1)[0]))
            last = len(segments) - 1
    return segments, last
