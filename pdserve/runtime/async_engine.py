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

Failure: an engine step that raises, a command that raises an internal error (anything but the
request errors ValueError, KeyError and QueueFullError: a KVLeakError means the block accounting
is corrupt), or a fire-and-forget command that raises marks the engine *failed*: every open
request and every later call gets EngineDeadError (UNAVAILABLE at the worker's edge) naming the
first failure, and the `on_failure` listeners hear of it once (the worker turns its health
NOT_SERVING). Cleanup commands (`call_soon`, aborts) still run, so the accounting stays as right
as it can. `inject_fault_for_tests` (PDSERVE_TEST_ENGINE_FAULT_AFTER_STEPS) fails a step on purpose.
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
from pdserve.runtime.engine import Engine, QueueFullError, RequestError, StepOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a command may raise about its request without the engine being at fault.
REQUEST_ERRORS = (ValueError, KeyError, QueueFullError)


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
        self.failure: str | None = None  # why the engine failed; None while it is healthy
        self._failure_listeners: list[Callable[[str], None]] = []
        self._fault_at_step: int | None = None
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

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """Calls `listener(reason)` once when the engine fails (at once if it has failed already).
        It runs on whichever thread saw the failure: hand it to a loop with call_soon_threadsafe."""
        self._failure_listeners.append(listener)
        if self.failure is not None:
            listener(self.failure)

    def inject_fault_for_tests(self, after_steps: int) -> None:
        """Tests only: the first engine step after `after_steps` more steps raises, as a bug would."""
        self._fault_at_step = self.engine.stats.steps + after_steps

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("engine failed (%s): refusing new requests, health reports NOT_SERVING", reason)
        self._fail_all(self._dead_error())
        for listener in self._failure_listeners:
            try:
                listener(reason)
            except Exception:  # noqa: BLE001 - e.g. its loop closed at shutdown; the engine thread goes on
                log.exception("engine failure listener failed")

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"this worker's engine failed ({self.failure}); it reports NOT_SERVING"
                               " until restarted: send the request to another worker")

    # ---- the asyncio side ---------------------------------------------------------------
    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except REQUEST_ERRORS as exc:
                loop.call_soon_threadsafe(_settle, future, None, exc)
            except Exception as exc:  # noqa: BLE001 - an engine bug: fail the engine, not just this call
                log.exception("engine command failed")
                self._fail(f"{type(exc).__name__}: {exc}")
                loop.call_soon_threadsafe(_settle, future, None, self._dead_error())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    def call_soon(self, fn: Callable[[Engine], Any]) -> None:
        """Runs `fn(engine)` on the engine thread without waiting for it, even on a failed engine.

        For releases: submitting is synchronous, so a caller being cancelled cannot lose one (an
        awaited call would still run, but its caller could not act on the outcome). An error
        fails the engine (see the module docstring). A no-op once the engine thread has stopped:
        nothing is left to release then."""
        try:
            self._submit(lambda: fn(self.engine), cleanup=True)
        except EngineDeadError:
            log.debug("engine stopped: cleanup command dropped")

    async def generate(self, request_id: str, add: Callable[[Engine], Any]) -> AsyncIterator[list[StepOutput]]:
        """Adds a request with `add(engine)` and yields its outputs until it finishes.

        Each item is every output that arrived since the last one (usually one): when the
        consumer falls behind the engine, tokens are coalesced instead of queueing messages.
        Leaving early (client gone, cancellation, error) aborts the request and frees its KV.
        """
        if self.max_streams is not None and len(self._streams) >= self.max_streams:
            raise QueueFullError(f"worker has {len(self._streams)} requests open, its limit "
                                 "(--max-waiting + --max-batch-size): retry later")
        if request_id in self._streams:  # its outputs, and the abort on leaving, would hit the other one
            raise RequestError(f"request id {request_id!r} is already running on this worker")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        admission = _Admission()
        finished = False
        try:
            await self._admit(request_id, add, admission)
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
                # Runs after `add` (commands run in order), also when this caller was cancelled
                # while `add` was still on its way; a refused `add` left nothing to abort.
                self._submit(lambda: admission.added and self.engine.abort(request_id), cleanup=True)

    async def _admit(self, request_id: str, add: Callable[[Engine], Any], admission: "_Admission") -> None:
        """Runs `add` on the engine thread, noting when the request entered (and, when tracing, a span)."""
        def timed_add(engine: Engine) -> Any:
            result = add(engine)
            admission.added = True
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

    def _submit(self, command: Callable[[], Any], cleanup: bool = False) -> None:
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        if self.failure is not None and not cleanup:
            raise self._dead_error()
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
            try:
                command()
            except Exception as exc:  # noqa: BLE001 - a fire-and-forget command (abort, release) broke
                log.exception("engine command failed")
                self._fail(f"{type(exc).__name__}: {exc}")

    def _step(self) -> bool:
        """One engine step, its outputs delivered; False when it had nothing to run."""
        steps_before = self.engine.stats.steps
        counts_before = dict(self.engine.stats.batch_size_counts or {})
        start_ns = time.time_ns()
        start = time.perf_counter()
        try:
            self._maybe_inject_fault()
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not hang them
            log.exception("engine step failed; aborting its requests")
            self._fail(f"engine step failed: {type(exc).__name__}: {exc}")
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

    def _maybe_inject_fault(self) -> None:
        if self._fault_at_step is not None and self.engine.stats.steps >= self._fault_at_step:
            raise RuntimeError("fault injected for tests (inject_fault_for_tests)")

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


class _Admission:
    """Whether a request's `add` ran on the engine thread and succeeded (written there only)."""

    __slots__ = ("added",)

    def __init__(self) -> None:
        self.added = False


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
