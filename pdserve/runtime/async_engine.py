"""AsyncEngine: one Engine on its own thread, driven by asyncio servicers.

The engine is single-threaded by design (like vLLM's engine core): servicers hand it work
as closures through a queue; the thread runs them between steps, then steps while any
request is unfinished, and delivers each StepOutput to the asyncio queue of its request.
When the engine was idle, it waits a short batching window after the first arrival so
that requests arriving together start in one batch.

Bounded: at most `max_streams` requests are open at once (running, waiting, or on their way in);
the next `generate` fails at once with QueueFullError (RESOURCE_EXHAUSTED at the worker's edge)
without a trip to the engine thread. The engine's own waiting queue is bounded too
(SchedulerConfig.max_waiting, `--max-waiting`); workers set `max_streams` from both flags.

Observability (recording only, no behaviour): every step feeds `engine_metrics` (step time,
batch size, queue time of each request's first token; running/waiting/KV gauges each loop turn).
With tracing on, admitting a request is an "engine.admit" span under the RPC that asked, and each
step is one "engine.step" span with the batch size as an attribute. A step serves many requests
from many traces, so it has no parent: it is a root span with a *link* to the span of each request
that got a token from it (parenting it to one request would misattribute the others' time, and a
span per request per step is what "never one span per token" rules out). With tracing off none of
this builds a span object: `telemetry.enabled()` is checked first.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pdserve import telemetry
from pdserve.runtime import engine_metrics
from pdserve.runtime.engine import Engine, QueueFullError, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; the request cannot complete here."""


class AsyncEngine:
    def __init__(self, engine: Engine, batch_window_s: float = 0.002, max_streams: int | None = None) -> None:
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.max_streams = max_streams  # None: only the engine's waiting queue bounds requests
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._tracing = telemetry.enabled()
        # request id -> its RPC's span context (for step links); request id -> when it entered the
        # engine (for queue time, popped at its first token). Written on the asyncio side or in
        # `add` closures, read on the engine thread: single dict operations, safe under the GIL.
        self._trace_ctx: dict[str, Any] = {}
        self._entered_at: dict[str, float] = {}
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
        if self.max_streams is not None and len(self._streams) >= self.max_streams:
            raise QueueFullError(f"worker has {len(self._streams)} requests open, its limit "
                                 "(--max-waiting + --max-batch-size): retry later")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        try:
            await self._admit(request_id, add)
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
            self._trace_ctx.pop(request_id, None)
            self._entered_at.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    async def _admit(self, request_id: str, add: Callable[[Engine], Any]) -> None:
        """Runs `add` on the engine thread, noting when the request entered (and, when tracing, a span)."""
        def timed_add(engine: Engine) -> Any:
            result = add(engine)
            self._entered_at[request_id] = time.perf_counter()
            return result

        if not self._tracing:
            await self.call(timed_add)
            return
        ctx = telemetry.current_span_context()
        if ctx is not None:
            self._trace_ctx[request_id] = ctx
        with telemetry.tracer().start_as_current_span("engine.admit", attributes={"pdserve.request_id": request_id}):
            await self.call(timed_add)

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
            if self.engine.has_unfinished() and not self._step():
                # Nothing was schedulable (blocks held by finished prefills awaiting export):
                # wait for a command to change that instead of spinning a core.
                self._wake.wait(timeout=0.05)
            engine_metrics.refresh_gauges(self.engine)
        self._fail_all(EngineDeadError("the engine stopped"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> bool:
        """One engine step, its outputs delivered; False when it had nothing to run."""
        steps_before = self.engine.stats.steps
        counts_before = dict(self.engine.stats.batch_size_counts or {})
        start_ns = time.time_ns()
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not hang them
            log.exception("engine step failed; aborting its requests")
            self._fail_all(EngineDeadError(f"engine step failed: {exc}"))
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
            return True
        self._record_step(outputs, counts_before, start, start_ns)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, deliveries in by_loop.items():  # one wake-up of each loop per step
            loop.call_soon_threadsafe(_deliver, deliveries)
        return self.engine.stats.steps != steps_before

    def _record_step(self, outputs: list[StepOutput], counts_before: dict[int, int],
                     start: float, start_ns: int) -> None:
        seconds = time.perf_counter() - start
        batch = engine_metrics.last_batch_size(counts_before, self.engine.stats.batch_size_counts or {})
        if batch:
            engine_metrics.observe_step(seconds, batch)
        for out in outputs:
            entered = self._entered_at.pop(out.request_id, None)
            if entered is not None:  # this request's first token
                engine_metrics.observe_queue(max(start - entered, 0.0))
        if self._tracing:
            self._trace_step(outputs, batch, start_ns)

    def _trace_step(self, outputs: list[StepOutput], batch: int, start_ns: int) -> None:
        """One root span for the step, linked to every request that got a token from it."""
        from opentelemetry.context import Context
        from opentelemetry.trace import Link

        links, seen = [], set()
        for out in outputs:
            ctx = self._trace_ctx.get(out.request_id)
            if ctx is not None and out.request_id not in seen:
                seen.add(out.request_id)
                links.append(Link(ctx))
        span = telemetry.tracer().start_span(
            "engine.step", context=Context(), links=links, start_time=start_ns,
            attributes={"pdserve.batch_size": batch, "pdserve.outputs": len(outputs),
                        "pdserve.running": len(self.engine.scheduler.running),
                        "pdserve.waiting": len(self.engine.scheduler.waiting)})
        span.end()

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
