"""AsyncEngine: one Engine on its own thread, and the typed commands the worker services use.

The engine is single-threaded by design (like vLLM's engine core). Services never touch it or its
block references: they send commands (`generate` with an AddRequest, `pin` / `unpin`, `place`,
`export_held`, `export_cached`, `resident`, `check_leaks`) whose arguments and results are plain
data; the thread runs them between steps, then steps while any request is unfinished, and
delivers each StepOutput to the asyncio queue of its request. Two reads need no trip to the
thread: `is_resident(hash)` (one dict lookup, a hint that may be stale: the engine re-checks
whatever it is used for) and `load` (a snapshot published after every loop turn). When the engine
was idle, it waits a short batching window after the first arrival so that requests arriving
together start in one batch. Holds on prefetched blocks expire on this thread too.

The path of one disaggregated request, and where each structure lives:

    client ──HTTP/gRPC──▶ gateway process, asyncio loop: prompt text -> token ids (tokenizers, a
        thread for long prompts); KVFormat.full_block_hashes -> kvstore Lookup (gRPC) -> how many
        leading blocks the store holds; a prefill and a decode worker picked.
    ──Prefill (gRPC)──▶ prefill worker process, asyncio loop (prefill.service): `pin` the prefix
        blocks resident here (engine thread, PinTable); fetch the rest from the kvstore (gRPC,
        bytes -> CPU tensors decoded in a thread, kvwire, MAC checked); `generate(AddRequest(...,
        blocks, hold_blocks=True))`: the Sequence carries the fetched tensors (ExternalKV) into
        Scheduler.waiting. Engine thread: admission allocates its blocks, the loads are copied
        into the paged KV cache (CPU or GPU tensor), the pins dropped; steps compute the rest and
        sample the first token; `export_held` copies the new blocks out (CPU) and releases them.
        Back on the loop: encoded (a thread) and streamed to the kvstore under the request's lease.
    ──kvstore process──▶ blocks in memory (bytes, LRU, content-addressed), Redis behind it.
    ──Decode (gRPC, server stream)──▶ decode worker process, asyncio loop (decode.service): the
        dispatch prefetch may have staged blocks already (pdserve.block_prefetch, CPU tensors);
        the rest fetched; `generate(AddRequest(..., first_token, prompt_hashes, blocks))`. Engine
        thread: admission shares what the paged cache holds and copies in the rest (or recomputes
        what is missing); every step appends one token per running sequence; StepOutputs go to
        the loop by call_soon_threadsafe, then as DecodeChunks to the gateway, which detokenizes
        and streams text to the client. Filled blocks are exported (`export_cached`) and written
        back to the kvstore in the background (decode.write_back).

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
NOT_SERVING). Cleanup commands (`unpin`, aborts) still run, so the accounting stays as right
as it can. `inject_fault_for_tests` (PDSERVE_TEST_ENGINE_FAULT_AFTER_STEPS) fails a step on purpose.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pdserve import telemetry, thread_policy
from pdserve.runtime import compute_threads, engine_metrics
from pdserve.runtime.engine import AddRequest, Engine, EngineLoad, QueueFullError, RequestError, StepOutput
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.runtime.pins import Owner
from pdserve.runtime.step_log import StepLog, StepRecord

if TYPE_CHECKING:
    from pdserve.runtime.core_share import WorkerCores

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a command may raise about its request without the engine being at fault.
REQUEST_ERRORS = (ValueError, KeyError, QueueFullError)
# How often a yielding engine looks again (core_share.WorkerCores.yields): a prefill worker's layer is
# tens of milliseconds, so the pause outlasts the yield by at most a fraction of one.
YIELD_POLL_S = 0.005


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; the request cannot complete here."""


class AsyncEngine:
    def __init__(self, engine: Engine, batch_window_s: float = 0.002, max_streams: int | None = None,
                 threads: int | None = None, cores: WorkerCores | None = None,
                 step_log: StepLog | None = None) -> None:
        """threads: torch CPU threads the engine thread claims for itself (a worker process, whose
        other threads run torch single-threaded: pdserve.runtime.compute_threads); None leaves
        the process's count. cores: this worker's side of the host's core share
        (pdserve.runtime.core_share), told before each step and when the engine idles. step_log:
        where each step's record goes (pdserve.runtime.step_log), written on the engine thread."""
        self.engine = engine
        self.threads = threads
        self.cores = cores
        self.step_log = step_log
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
        self._load = engine.load()
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

    # ---- commands (the asyncio side) ------------------------------------------------------
    async def pin(self, owner: Owner, hashes: list[bytes], ttl_s: float | None = None) -> int:
        """Pins the blocks of `hashes` the cache holds for `owner` (pdserve.runtime.pins); how many."""
        hashes = list(hashes)
        return await self._call(lambda e: e.pin(owner, hashes, ttl_s))

    def unpin(self, owner: Owner, hashes: Collection[bytes] | None = None) -> None:
        """Drops `owner`'s pins, without waiting; also on a failed engine (see `_cleanup`)."""
        hashes = None if hashes is None else set(hashes)
        self._cleanup(lambda e: e.unpin(owner, hashes))

    async def place(self, hashes: list[bytes], blocks: Mapping[bytes, torch.Tensor], hold: Owner | None = None,
                    hold_hashes: list[bytes] | None = None, ttl_s: float | None = None) -> list[bytes]:
        """Copies a chain of blocks into the cache as cached blocks (Engine.place); the hashes placed."""
        hashes = list(hashes)
        return await self._call(lambda e: e.place(hashes, blocks, hold, hold_hashes, ttl_s))

    async def export_held(self, request_id: str, skip: Collection[bytes] = ()) -> list[ExportedBlock]:
        """Copies of a held prefill's prompt blocks but `skip`; the blocks are released on the
        engine thread whatever happens to this caller."""
        skip = frozenset(skip)

        def export_and_release(engine: Engine) -> list[ExportedBlock]:
            try:
                return engine.export_held(request_id, skip)
            finally:
                engine.release_held(request_id)
        return await self._call(export_and_release)

    async def export_cached(self, hashes: list[bytes]) -> list[ExportedBlock]:
        hashes = list(hashes)
        return await self._call(lambda e: e.export_cached(hashes))

    async def resident(self) -> frozenset[bytes]:
        """Hashes of every full block the cache holds."""
        return await self._call(lambda e: e.resident())

    async def check_leaks(self) -> None:
        """KVLeakError (as EngineDeadError: the accounting is corrupt) unless every reference is owned."""
        await self._call(lambda e: e.check_leaks())

    def is_resident(self, block_hash: bytes) -> bool:
        """Whether the cache holds this block now: a hint read off the engine thread (one dict
        lookup), for saving transfers; whatever it decides, the engine re-checks."""
        return self.engine.block_manager.is_resident(block_hash)

    @property
    def load(self) -> EngineLoad:
        """What the engine was doing after its last loop turn."""
        return self._load

    async def _call(self, fn: Callable[[Engine], T]) -> T:
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

    def _cleanup(self, fn: Callable[[Engine], Any]) -> None:
        """Runs `fn(engine)` on the engine thread without waiting for it, even on a failed engine.

        For releases: submitting is synchronous, so a caller being cancelled cannot lose one (an
        awaited call would still run, but its caller could not act on the outcome). An error
        fails the engine (see the module docstring). A no-op once the engine thread has stopped:
        nothing is left to release then."""
        try:
            self._submit(lambda: fn(self.engine), cleanup=True)
        except EngineDeadError:
            log.debug("engine stopped: cleanup command dropped")

    async def generate(self, request: AddRequest) -> AsyncIterator[list[StepOutput]]:
        """Adds `request` and yields its outputs until it finishes.

        Each item is every output that arrived since the last one (usually one): when the
        consumer falls behind the engine, tokens are coalesced instead of queueing messages.
        Leaving early (client gone, cancellation, error) aborts the request and frees its KV.
        """
        request_id = request.request_id
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
            await self._admit(request, admission)
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

    async def _admit(self, request: AddRequest, admission: "_Admission") -> None:
        """Adds `request` on the engine thread, noting when it entered (and, when tracing, a span)."""
        request_id = request.request_id

        def timed_add(engine: Engine) -> None:
            engine.add(request)
            admission.added = True
            self._entered_at[request_id] = time.perf_counter()

        if not self._tracing:
            await self._call(timed_add)
            return
        ctx = telemetry.current_span_context()
        if ctx is not None:
            self._trace_ctx[request_id] = ctx
        with telemetry.tracer().start_as_current_span("engine.admit", attributes={"pdserve.request_id": request_id}):
            await self._call(timed_add)

    def _submit(self, command: Callable[[], Any], cleanup: bool = False) -> None:
        if self._stopping or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        if self.failure is not None and not cleanup:
            raise self._dead_error()
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        # Named, and out of SCHED_BATCH if the process put its threads there (pdserve.thread_policy),
        # before its first parallel op starts its OpenMP team, which inherits both.
        thread_policy.run_as_compute_thread()
        if self.threads:
            compute_threads.claim(self.threads)
        while not self._stopping:
            was_idle = not self.engine.has_unfinished()
            if was_idle:
                if self.cores is not None:
                    self.cores.idle()
                self._wake.wait(timeout=0.5)
                if self.batch_window_s and not self._commands.empty():
                    time.sleep(self.batch_window_s)  # let requests that arrive together batch
            self._wake.clear()
            self._drain_commands()
            self.engine.pins.expire()
            if self.engine.has_unfinished():
                if self._yielding():
                    self._wake.wait(timeout=YIELD_POLL_S)
                elif not self._step():
                    # Nothing was schedulable (blocks held by finished prefills awaiting export):
                    # wait for a command to change that instead of spinning a core.
                    self._wake.wait(timeout=0.05)
            engine_metrics.refresh_gauges(self.engine)
            self._load = self.engine.load()
        if self.step_log is not None:
            self.step_log.close()
        self._fail_all(EngineDeadError("the engine stopped"))

    def _yielding(self) -> bool:
        """Whether the engine leaves the host's cores to the other kind of worker for now
        (core_share.WorkerCores.yields), its claim released meanwhile."""
        if self.cores is None:
            return False
        scheduler = self.engine.scheduler
        if not self.cores.yields(len(scheduler.running) + len(scheduler.waiting), scheduler.config.max_num_seqs):
            return False
        self.cores.idle()
        return True

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
            if self.cores is not None:
                self.cores.before_step()
            step_start, cpu_start = time.perf_counter(), time.thread_time()
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a bug must fail requests, not hang them
            log.exception("engine step failed; aborting its requests")
            self._fail(f"engine step failed: {type(exc).__name__}: {exc}")
            for request_id in list(self.engine.seqs):
                self.engine.abort(request_id)
            return True
        if self.step_log is not None:
            self._log_step(step_start, cpu_start)
        self._record_step(outputs, counts_before, start, start_ns)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, deliveries in by_loop.items():  # one wake-up of each loop per step
            loop.call_soon_threadsafe(_deliver, deliveries)
        return self.engine.stats.steps != steps_before

    def _log_step(self, start: float, cpu_start: float) -> None:
        out = self.engine.last_schedule
        if out.is_empty:
            return  # nothing was schedulable
        threads = self.cores.threads if self.cores is not None else torch.get_num_threads()
        self.step_log.record(StepRecord(start, round((time.perf_counter() - start) * 1e3, 3),
                                        round((time.thread_time() - cpu_start) * 1e3, 3), threads, len(out.decodes),
                                        sum(s.num_new_tokens for s in out.prefills), len(out.loads)))

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
