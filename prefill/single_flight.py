"""SingleFlight: one run of the work per request id, however many calls ask for it.

Why: the gateway retries a Prefill whose worker answered UNAVAILABLE, and a client or proxy may
retry too; a retry that lands on a worker still running the same request id must not start a
second sequence (the engine would refuse the duplicate id) nor pin the blocks twice. It joins
the run in progress and gets the same answer. The run is cancelled only when every caller has
gone (a cancelled RPC stops the work it alone was waiting for).
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


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._runs: dict[str, _Run[T]] = {}
        self.joined = 0  # calls that joined a run already in progress

    def running(self, key: str) -> bool:
        return key in self._runs

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> T:
        """The result of `work()` for `key`, shared with every concurrent call for the same key."""
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _Run(asyncio.ensure_future(work()))
            run.task.add_done_callback(lambda _: self._runs.pop(key, None))
        else:
            self.joined += 1
        run.callers += 1
        try:
            return await asyncio.shield(run.task)
        finally:
            run.callers -= 1
            if run.callers == 0 and not run.task.done():
                run.task.cancel()
