"""AsyncEngine: one Engine on its own thread, driven by asyncio servicers.

The engine is single-threaded by design (like vLLM's engine core): servicers hand it work
as closures through a queue; the thread runs them between steps, then steps while any
request is unfinished, and delivers each StepOutput to the asyncio queue of its request.
When the engine was idle, it waits a short batching window after the first arrival so
that requests arriving together start in one batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pdserve.runtime.engine import Engine, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; the request cannot complete here."""


class AsyncEngine:
    def __init__(self, engine: Engine, batch_window_s: float = 0.002) -> None:
        self.engine = engine
        self.batch_window_s = batch_window_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- the asyncio side ---------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    async def generate(self, request_id: str, add: Callable[[Engine], Any]) -> AsyncIterator[list[StepOutput]]:
        """Adds a request with `add(engine)` and yields its outputs until it finishes.

        Each item is every output that arrived since the last one (usually one): when the
        consumer falls behind the engine, tokens are coalesced instead of queueing messages.
        Leaving early (client gone, cancellation, error) aborts the request and frees its KV.
        """
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        try:
            await self.call(add)
            while not finished:
                batch = [await outputs.get()]
                while not outputs.empty():
                    batch.append(outputs.get_nowait())
                for out in batch:
                    if isinstance(out, BaseException):
                        raise out
                finished = batch[-1].finished
                yield batch
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            was_idle = not self.engine.has_unfinished()
            if was_idle:
                self._wake.wait(timeout=0.5)
                if self.batch_window_s and not self._commands.empty():
                    time.sleep(self.batch_window_s)  # let requests that arrive together batch
            self._wake.clear()
            self._drain_commands()
            if self.engine.has_unfinished():
                self._step()
        self._fail_all(EngineDeadError("the engine stopped"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not hang them
            log.exception("engine step failed; aborting its requests")
            self._fail_all(EngineDeadError(f"engine step failed: {exc}"))
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, deliveries in by_loop.items():  # one wake-up of each loop per step
            loop.call_soon_threadsafe(_deliver, deliveries)

    def _fail_all(self, exc: BaseException) -> None:
        for loop, outputs_queue in list(self._streams.values()):
            loop.call_soon_threadsafe(outputs_queue.put_nowait, exc)


def _deliver(deliveries: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for outputs_queue, out in deliveries:
        outputs_queue.put_nowait(out)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return  # the caller was cancelled meanwhile
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
