"""The part every scripted test backend shares: generations it finishes come back from finished().

A scripted backend subclasses FinishedQueue, calls `finish(generation)` when a request ends (at once in
submit(), or later from abort()), and gets the Backend protocol's `finished()`: wait until at least one
request ended, return every ended one. Cancel-safe, as the loop needs: a cancelled wait takes nothing.
"""

from __future__ import annotations

import asyncio

from flashreinforce.types import Generation


class FinishedQueue:
    def __init__(self) -> None:
        self.done: list[Generation] = []
        self.arrived = asyncio.Event()

    def finish(self, generation: Generation) -> None:
        self.done.append(generation)
        self.arrived.set()

    async def finished(self) -> list[Generation]:
        while not self.done:
            self.arrived.clear()
            await self.arrived.wait()
        done, self.done = self.done, []
        return done
