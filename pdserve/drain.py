"""Drain: how a worker leaves without losing a request (scale-in, rolling update, node drain).

On SIGTERM (`grpc_server.serve_until_signal`) a worker reports NOT_SERVING, so the gateway's
probes stop routing to it, and `Drain.run` takes over:

1. New calls are refused with UNAVAILABLE (`Drain.call`): the gateway sends them elsewhere (a
   Decode is resumed on another decode worker, a Prefill retried on another prefill worker) even
   before its next probe has seen NOT_SERVING.
2. Calls in flight run on until they finish by themselves or the drain deadline
   (`--drain-timeout-s`, PDSERVE_DRAIN_TIMEOUT_S) passes.
3. At the deadline the rest are handed over: each call waiting on `Drain.unless_handed_over`
   (its engine's next output, its prefix fetch) stops waiting and raises `HandedOver`, an
   UNAVAILABLE error. A decode stream first waits (bounded) for the write-back of its full
   blocks, then ends with it; the gateway treats that as a lost decode worker and resumes the
   stream on another from the written-back KV (gateway.resume), so the client sees every token
   once. The handed-over calls end within `HANDOVER_S`, then the process stops.

Why the handover waits only at awaits the handler marks, and not by cancelling the handler's
task: a cancel landing in grpc's own code (a write in progress) ends the call with CANCELLED, before
the stream's unsent tokens and its write-back. The gateway does resume a call its worker cancelled
(gateway.worker_calls.worker_error: a stopping server cancels the calls that reach it after the
drain counted them), but then recomputes what the write-back would have saved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import grpc

from pdserve.grpc_server import ServiceError

log = logging.getLogger(__name__)
T = TypeVar("T")

# After the deadline, how long the handed-over calls get to end (a stream's last write-backs are
# bounded by HANDOVER_FLUSH_S within it); whatever is left then is cancelled by the server stop.
HANDOVER_S = 10.0
HANDOVER_FLUSH_S = 5.0


class HandedOver(ServiceError):
    """A call ended by the drain deadline: UNAVAILABLE, so the gateway resumes or retries it elsewhere."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class Drain:
    """The calls in flight on one worker's servicer, and its going away (see the module docstring).
    `kind` names the worker in messages ("decode worker host:port")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.draining = False  # new calls are refused
        self.handing_over = False  # the deadline passed: calls in flight are handed over
        self.handed_over = 0  # calls ended by the handover so far
        self._calls = 0
        self._idle: asyncio.Event | None = None  # set while no call is in flight (made on the loop)
        self._waits: set[asyncio.Timeout] = set()

    @property
    def calls(self) -> int:
        """Calls in flight (inside `call`)."""
        return self._calls

    @contextmanager
    def call(self) -> Iterator[None]:
        """Counts one call in flight for the block; UNAVAILABLE at once while draining."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.kind} is shutting down (draining): send the request to another worker")
        self._calls += 1
        self._idle_event().clear()
        try:
            yield
        finally:
            self._calls -= 1
            if self._calls == 0:
                self._idle_event().set()

    async def unless_handed_over(self, wait: Awaitable[T]) -> T:
        """`await wait`, unless the drain deadline passes first: then `wait` is cancelled and
        HandedOver raised. Never spans a yield of a streaming handler (see the module docstring)."""
        if self.handing_over:  # not even started: a wait that needs no suspension would never see the cancel
            getattr(wait, "close", lambda: None)()
            raise self._handed_over()
        try:
            async with asyncio.timeout(None) as timeout:
                self._waits.add(timeout)
                try:
                    return await wait
                finally:
                    self._waits.discard(timeout)
        except TimeoutError:
            if not (self.handing_over and timeout.expired()):
                raise  # `wait`'s own timeout, not ours
            raise self._handed_over() from None

    def _handed_over(self) -> HandedOver:
        self.handed_over += 1
        return HandedOver(f"{self.kind} is shutting down: its drain deadline (--drain-timeout-s) passed, "
                          "so this call was handed over; resume or retry it on another worker")

    async def run(self, timeout_s: float) -> None:
        """Refuse new calls, let those in flight run for `timeout_s`, hand over the rest and wait
        (at most HANDOVER_S) for them to end."""
        self.draining = True
        start = time.monotonic()
        if self._calls:
            log.info("draining: %d calls in flight, deadline %.1f s (--drain-timeout-s)", self._calls, timeout_s)
        if await self._wait_idle(timeout_s):
            log.info("drained: every call finished (%.1f s)", time.monotonic() - start)
            return
        log.warning("drain deadline (%.1f s) passed with %d calls in flight: handing them over", timeout_s,
                    self._calls)
        self.handing_over = True
        for timeout in list(self._waits):
            _expire(timeout)
        if await self._wait_idle(HANDOVER_S):
            log.info("drained: %d calls handed over (%.1f s)", self.handed_over, time.monotonic() - start)
        else:
            log.warning("%d calls still running %.0f s after the handover; stopping anyway", self._calls, HANDOVER_S)

    async def _wait_idle(self, timeout_s: float) -> bool:
        if not self._calls:
            return True
        try:
            await asyncio.wait_for(self._idle_event().wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            self._idle.set()
        return self._idle


def _expire(timeout: asyncio.Timeout) -> None:
    if not timeout.expired():  # rescheduling an expiring timeout raises
        timeout.reschedule(asyncio.get_running_loop().time())
