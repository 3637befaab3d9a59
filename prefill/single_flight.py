"""SingleFlight: one run of the work per request id, however many calls ask for it.

Why: the gateway retries a Prefill whose worker answered UNAVAILABLE, and a client or proxy may
retry too; a retry that lands on a worker still running the same request id must not start a
second sequence (the engine would refuse the duplicate id) nor pin the blocks twice. It joins
the run in progress and gets the same answer. The run is cancelled only when every caller has
gone (a cancelled RPC stops the work it alone was waiting for); a call for the same id arriving
while a cancelled run still cleans up waits for it to end, then runs anew.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class _Run(Generic[T]):
    def __init__(self, task: asyncio.Future[T]) -> None:
        self.task = task
        self.callers = 0
        self.abandoned = False  # every caller left: cancelled, cleaning up


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._runs: dict[str, _Run[T]] = {}
        self.joined = 0  # calls that joined a run already in progress

    def running(self, key: str) -> bool:
        return key in self._runs

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> T:
        """The result of `work()` for `key`, shared with every concurrent call for the same key."""
        run = await self._live_run(key)
        if run is None:
            run = self._runs[key] = _Run(asyncio.ensure_future(work()))
            run.task.add_done_callback(lambda _: self._forget(key, run))
        else:
            self.joined += 1
        run.callers += 1
        try:
            return await asyncio.shield(run.task)
        finally:
            run.callers -= 1
            if run.callers == 0 and not run.task.done():
                run.abandoned = True
                run.task.cancel()

    async def _live_run(self, key: str) -> _Run[T] | None:
        """The run of `key` to join, if any. A call arriving while an abandoned run still cleans up
        (releasing its blocks and its lease) waits for it to end and then starts afresh: joining
        would answer it CANCELLED, and overlapping would let the old cleanup end the new lease."""
        while (run := self._runs.get(key)) is not None and run.abandoned:
            if run.task.done():
                return None  # ended; its entry goes with the next loop turn
            await asyncio.wait([run.task])
        return run

    def _forget(self, key: str, run: _Run[T]) -> None:
        if self._runs.get(key) is run:
            del self._runs[key]
