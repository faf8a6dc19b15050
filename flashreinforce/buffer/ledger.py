"""The exactly-once ledger: every scheduled rollout ends trained once or dropped once.

Each RolloutKey moves scheduled -> trained(step) | dropped(reason), and never again. The ledger is an
auditor, not a gatekeeper: a mark that breaks the rule is recorded as a violation (the key keeps its first
outcome) and `check()` raises with every offending key, so one run reports all its bugs at once.
It knows nothing about schedulers, prompts or trajectories.
"""

from __future__ import annotations

from collections import Counter

from flashreinforce.types import RolloutKey

Status = int | str | None
"""None: scheduled, outcome pending; int: trained at that optimizer step; str: dropped for that reason."""

_MAX_REPORTED = 20
"""How many offending keys check() spells out; the message still counts all of them."""


class Ledger:
    """Exactly-once accounting of RolloutKeys. O(1) marks; a dict of ~1e6 small entries is fine.

    >>> ledger = Ledger()
    >>> ledger.schedule(RolloutKey("p0", 0)); ledger.schedule(RolloutKey("p1", 0))
    >>> ledger.train(RolloutKey("p0", 0), step=0); ledger.drop(RolloutKey("p1", 0), "stale")
    >>> ledger.summary()
    {'scheduled': 2, 'trained': 1, 'outstanding': 0, 'dropped/stale': 1}
    """

    def __init__(self) -> None:
        self._status: dict[RolloutKey, Status] = {}  # insertion order = scheduling order
        self._trained = 0
        self._dropped: Counter[str] = Counter()
        self._violations: list[tuple[RolloutKey, str]] = []

    def __len__(self) -> int:
        return len(self._status)

    def __contains__(self, key: object) -> bool:
        return key in self._status

    def schedule(self, key: RolloutKey) -> None:
        if key in self._status:
            self._violations.append((key, f"scheduled twice (already {_describe(self._status[key])})"))
            return
        self._status[key] = None

    def train(self, key: RolloutKey, step: int) -> None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"Ledger.train({key}): step must be an int >= 0 (the optimizer step), got {step!r}")
        if self._record(key, f"trained at step {step}"):
            self._status[key] = step
            self._trained += 1

    def drop(self, key: RolloutKey, reason: str) -> None:
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"Ledger.drop({key}): reason must be a non-empty string such as 'stale', got {reason!r}")
        if self._record(key, f"dropped ({reason})"):
            self._status[key] = reason
            self._dropped[reason] += 1

    def _record(self, key: RolloutKey, outcome: str) -> bool:
        """True if `key` may take an outcome now; otherwise log why not and leave its first outcome."""
        if key not in self._status:
            self._violations.append((key, f"{outcome} but never scheduled"))
            return False
        status = self._status[key]
        if status is not None:
            self._violations.append((key, f"{outcome} but already {_describe(status)}"))
            return False
        return True

    def status(self, key: RolloutKey) -> Status:
        """None while outstanding, the step if trained, the reason if dropped. KeyError if never scheduled."""
        return self._status[key]

    def outstanding(self) -> list[RolloutKey]:
        """Keys scheduled but neither trained nor dropped, in scheduling order. O(len)."""
        return [key for key, status in self._status.items() if status is None]

    def trained(self) -> dict[RolloutKey, int]:
        return {key: s for key, s in self._status.items() if isinstance(s, int)}

    def dropped(self) -> dict[RolloutKey, str]:
        return {key: s for key, s in self._status.items() if isinstance(s, str)}

    def summary(self) -> dict[str, int]:
        """Counts: scheduled, trained, outstanding and dropped/<reason> for each reason seen. O(#reasons)."""
        dropped = sum(self._dropped.values())
        counts = {"scheduled": len(self._status), "trained": self._trained,
                  "outstanding": len(self._status) - self._trained - dropped}
        counts.update({f"dropped/{reason}": n for reason, n in sorted(self._dropped.items())})
        return counts

    def check(self) -> None:
        """Raise AssertionError naming the offending keys if any mark broke exactly-once. O(1) when clean."""
        if not self._violations:
            return
        lines = [f"  {key}: {problem}" for key, problem in self._violations[:_MAX_REPORTED]]
        more = len(self._violations) - len(lines)
        raise AssertionError(f"exactly-once violated {len(self._violations)} times:\n" + "\n".join(lines)
                             + (f"\n  ... and {more} more" if more else ""))

    def state_dict(self) -> dict:
        """JSON-friendly: lists of [prompt_id, sample, status]."""
        return {"entries": [[key.prompt_id, key.sample, s] for key, s in self._status.items()],
                "violations": [[key.prompt_id, key.sample, problem] for key, problem in self._violations]}

    def load_state_dict(self, state: dict) -> None:
        self.__init__()
        for prompt_id, sample, status in state["entries"]:
            if not (status is None or isinstance(status, (int, str))):
                raise ValueError(f"ledger state: entry ({prompt_id!r}, {sample}) has status {status!r}; "
                                 "expected null, a step or a reason: the checkpoint is corrupt")
            self._status[RolloutKey(prompt_id, sample)] = status
            if isinstance(status, int):
                self._trained += 1
            elif isinstance(status, str):
                self._dropped[status] += 1
        self._violations = [(RolloutKey(p, s), problem) for p, s, problem in state["violations"]]


def _describe(status: Status) -> str:
    if status is None:
        return "scheduled"
    if isinstance(status, int):
        return f"trained at step {status}"
    return f"dropped ({status})"
