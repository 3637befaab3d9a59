"""What prefill and decode workers share: flags, engine start-up, error codes, stats, the
request's kvstore lease (`RequestLease`), and health that follows the engine (a failed engine
turns the worker NOT_SERVING)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc

from kvstore.client import KVStoreClient, PutResult
from pdserve import kv_mac
from pdserve import telemetry, thread_policy
from pdserve.grpc_server import DEFAULT_ERROR_CODES, mark_not_serving, serve_until_signal, start_server
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError
from pdserve.runtime.engine import QueueFullError
from pdserve.runtime.step_log import StepLog
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.v1 import worker_pb2
from pdserve.worker_config import ENGINE_FAULT_ENV, WorkerConfig  # noqa: F401 (ENGINE_FAULT_ENV: re-exported)

log = logging.getLogger(__name__)
T = TypeVar("T")

# A kvstore call that takes longer is given up (the worker computes the KV instead): a store that
# hangs rather than dies must not hang requests. Generous, as one call may move hundreds of MB.
KVSTORE_TIMEOUT_S = 30.0

# Engine exceptions -> gRPC status codes (first match wins).
WORKER_ERROR_CODES = {
    QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    EngineDeadError: grpc.StatusCode.UNAVAILABLE,
    **DEFAULT_ERROR_CODES,
}


@dataclass
class TransferCounters:
    kv_bytes_received: int = 0
    kv_bytes_sent: int = 0


class KVOutage:
    """Logs failed kvstore calls once per outage (a warning), then the recovery: while the store is
    down every request falls back to computing its KV, and one line per request would flood the log."""

    def __init__(self) -> None:
        self.down = False
        self.failures = 0  # failed calls since start

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        detail = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        if not self.down:
            log.warning("kvstore unreachable (%s: %s): computing KV locally until it is back", what, detail)
        else:
            log.debug("kvstore still unreachable (%s: %s)", what, detail)
        self.down = True

    def ok(self) -> None:
        if self.down:
            log.info("kvstore reachable again")
        self.down = False


@dataclass
class Worker:
    """One worker's parts: the engine on its thread, the kvstore client, the block format."""

    worker_id: str
    aengine: AsyncEngine
    kv: KVStoreClient
    kv_format: KVFormat  # of this worker's blocks: their hashes and wire header
    counters: TransferCounters
    kv_outage: KVOutage = field(default_factory=KVOutage)
    # The cluster KV MAC key (pdserve.kv_mac; b"": blocks go unsigned and are read unchecked).
    mac_key: bytes = field(default=b"", repr=False)
    # Every worker setting (run_worker built it from the flags and environment): what the
    # servicers read instead of the environment. The defaults for workers built in tests.
    config: WorkerConfig = field(default_factory=WorkerConfig)

    def stats(self) -> worker_pb2.WorkerStats:
        load = self.aengine.load
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, num_running=load.num_running, num_waiting=load.num_waiting,
            num_blocks_total=load.num_blocks_total, num_blocks_free=load.num_blocks_free,
            num_blocks_cached=load.num_blocks_cached, num_steps=load.num_steps,
            max_batch_size=load.max_batch_size, batch_size_counts=load.batch_size_counts,
            tokens_generated=load.tokens_generated, kv_bytes_received=self.counters.kv_bytes_received,
            kv_bytes_sent=self.counters.kv_bytes_sent)


class RequestLease:
    """The kvstore lease of one request on this worker (named by the request id), and the one place
    that ends it: `end` releases it exactly once, after every call made under it has finished.

    Why wait: a put or get cancelled on our side may still be processed by the store after a
    release sent at once, pinning blocks under a lease nobody ends again (it then lives until the
    store's TTL, 120 s). So calls under the lease run shielded: a cancelled request stops waiting
    for them, and they end by themselves (bounded by KVSTORE_TIMEOUT_S) before the release goes."""

    def __init__(self, worker: Worker, request_id: str) -> None:
        self.worker = worker
        self.request_id = request_id
        self._calls: set[asyncio.Future] = set()
        self._release: asyncio.Future | None = None

    async def run(self, call: Awaitable[T]) -> T:
        """Awaits `call` (one that pins under this lease), which goes on if the caller is cancelled."""
        task = asyncio.ensure_future(call)
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return await asyncio.shield(task)

    def end(self, drop: bool) -> asyncio.Future:
        """Release the lease in the background, once; `drop` (the request failed or was cancelled)
        also deletes its blocks nobody else used. Returns the release's task (the same one on
        later calls, whatever their `drop`); awaiting it is optional."""
        if self._release is None:
            self._release = _spawn(self._release_after(list(self._calls), drop))
        return self._release

    async def _release_after(self, calls: list[asyncio.Future], drop: bool) -> None:
        await asyncio.gather(*calls, return_exceptions=True)  # their outcome was someone else's
        try:
            await self.worker.kv.release(self.request_id, drop=drop)
        except Exception as exc:  # noqa: BLE001 - the lease expires by itself in the store
            self.worker.kv_outage.failed(f"release of {self.request_id}", exc)


_background: set[asyncio.Task] = set()


def _spawn(coro: Awaitable[None]) -> asyncio.Future:
    # A task of its own, referenced until done: it must run even when its caller is being cancelled.
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def report_engine_failure(worker: Worker, server: grpc.aio.Server) -> None:
    """When the worker's engine fails (internal error, corrupt block accounting), its health turns
    NOT_SERVING for good: the gateway's probes route around it, and `pdserve up` or the
    orchestrator sees a worker to restart (its calls answer UNAVAILABLE meanwhile)."""
    loop = asyncio.get_running_loop()

    def failed(reason: str) -> None:  # on the engine thread
        loop.call_soon_threadsafe(_spawn, mark_not_serving(server, f"engine failed: {reason}"))
    worker.aengine.on_failure(failed)


def record_transfer(worker: Worker, direction: str, nbytes: int, seconds: float) -> None:
    """Count one batched KV transfer ("put": to the kvstore, "get": from it) in the metrics."""
    from pdserve.worker_metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS

    KV_TRANSFER_BYTES.labels(direction=direction).inc(nbytes)
    KV_TRANSFER_SECONDS.labels(direction=direction).observe(seconds)


async def put_blocks(worker: Worker, lease: str, blocks: Sequence[ExportedBlock]) -> PutResult:
    """Wire-encode exported blocks (off the loop) and put them into the kvstore under `lease` ("":
    unpinned), counting the bytes sent. Raises grpc.aio.AioRpcError when the store fails."""
    fmt, key = worker.kv_format, worker.mac_key
    encoded = await asyncio.to_thread(
        lambda: [(b.hash, encode_block(b.data, fmt, b.num_tokens, b.hash, key)) for b in blocks])
    start = time.perf_counter()
    result = await worker.kv.put_blocks(lease, encoded)
    nbytes = sum(len(d) for _, d in encoded)
    worker.counters.kv_bytes_sent += nbytes
    record_transfer(worker, "put", nbytes, time.perf_counter() - start)
    return result


def make_worker(args: argparse.Namespace, config: WorkerConfig) -> Worker:
    """The worker of the engine flags `args` (pdserve.engine_args) and the worker's `config`."""
    # Only the engine: the checkpoint's own weight tensors are not kept (214 MB of a fp32 SmolLM2
    # worker's RSS when held for the worker's life).
    from pdserve.engine_args import build_worker_engine
    from pdserve.runtime import compute_threads
    from pdserve.runtime.config import ConfigError
    from pdserve.runtime.parallel.launch import serve_with_ranks

    # Only the engine thread runs parallel torch ops (why: pdserve.runtime.compute_threads).
    threads = compute_threads.one_thread_by_default(args.threads)
    try:
        engine, ranks = compute_threads.run_claimed(threads, build_worker_engine, args, config.collective_timeout_s,
                                                    False)
    except ConfigError as err:  # a degree that does not split the model, flags that contradict
        raise SystemExit(f"pdserve worker: {err}") from None
    if ranks is not None:  # a rank that exits takes this worker down; they stop when it does
        serve_with_ranks(ranks)
    log.info("engine: %s compute, %s projections, KV %s in %d blocks of %d tokens", engine.config.dtype,
             engine.weight_format, engine.kv_format.kv_dtype, engine.config.cache.num_blocks,
             engine.kv_format.block_size)
    aengine = AsyncEngine(engine, batch_window_s=config.batch_window_s,
                          max_streams=args.max_waiting + args.max_batch_size, threads=threads,
                          cores=_core_share_side(args, config, engine, threads),
                          step_log=_step_log(args, config)).start()
    if config.engine_fault_after_steps:
        aengine.inject_fault_for_tests(config.engine_fault_after_steps)
    worker_id = config.worker_id or f"{socket.gethostname()}:{config.bind.rsplit(':', 1)[-1]}"
    kv = KVStoreClient(config.kvstore, timeout_s=KVSTORE_TIMEOUT_S,
                       shared_memory_bytes=int(config.kv_shared_memory_mb * 2**20))
    return Worker(worker_id, aengine, kv, engine.kv_format, TransferCounters(), mac_key=config.kv_mac_key,
                  config=config)


def _step_log(args: argparse.Namespace, config: WorkerConfig) -> StepLog | None:
    """This worker's step log (--step-log-dir), or None: off, or a file it cannot write (a measurement:
    the worker serves without it, and says why)."""
    if not config.step_log_dir:
        return None
    path = Path(config.step_log_dir) / f"{getattr(args, 'worker_role', '') or 'worker'}-{os.getpid()}.jsonl"
    try:
        step_log = StepLog(path)
    except OSError as err:
        log.warning("step log %s unavailable (%s): serving without it", path, err)
        return None
    log.info("step log: %s", path)
    return step_log


def _core_share_side(args: argparse.Namespace, config: WorkerConfig, engine, threads: int):
    """This worker's side of the host's core share (--core-share), or None: it holds its slot while
    it computes, and computes on --wide-threads while no worker of the other kind does, narrowing
    between layers as soon as one starts."""
    from pdserve.runtime import compute_threads
    from pdserve.runtime.core_share import CoreShare, WorkerCores

    if not config.core_share:
        return None
    try:
        share = CoreShare(config.core_share)
    except OSError as err:  # an optimization: the worker keeps to --threads without it
        log.warning("core share %s unavailable (%s): keeping to --threads %d", config.core_share, err, threads)
        return None
    model = engine.runner.model
    kind = "prefill" if getattr(args, "worker_role", "") == "prefill" else "decode"
    parallel = not hasattr(model, "one_call_decode_step")  # a parallel driver: its ranks keep to --threads
    wide = threads if parallel else max(config.wide_threads, threads)
    cores = WorkerCores(share, kind, config.core_share_slot, wide, threads, compute_threads.thread_setter(),
                        yield_s=config.decode_yield_s)  # 0 for a prefill worker: a decode-only setting
    if parallel:  # it still holds its claim while it computes: the other kind narrows meanwhile
        return cores
    model.between_layers = cores.between_layers
    plan = model.one_call_decode_step() if kind == "decode" else None  # planned once: weights packed by now
    if plan is not None and not args.step_threads:  # the C step takes the share's count of the moment
        plan.threads.wanted = lambda: cores.budget
    log.info("core share %s: %d threads while no %s worker computes, %d otherwise", config.core_share,
             cores.wide, cores.other, cores.narrow)
    return cores


def warn_if_unsigned(mac_key: bytes) -> None:
    """One warning at start when this worker has no KV MAC key: it then trusts every block it reads."""
    if not mac_key:
        log.warning("no KV MAC key (%s or %s): KV blocks are unauthenticated, so anyone who can write to "
                    "the kvstore or its Redis can feed this worker forged KV; give every prefill and decode "
                    "worker the same key (`pdserve up` generates one)", kv_mac.KEY_ENV, kv_mac.KEY_FILE_ENV)


def run_worker(args: argparse.Namespace, service_name: str,
               add_servicer: Callable[[Worker, grpc.aio.Server], object]) -> int:
    """Builds the worker's config (the flags and the environment, read here once) and the worker,
    serves until SIGINT/SIGTERM, drains (`add_servicer` returns the servicer, whose `drain` is a
    pdserve.drain.Drain: running calls get --drain-timeout-s to finish, then are handed over), then
    stops cleanly; 2 with a one-line message when a setting is bad (before any model is loaded)."""
    name = service_name.rsplit(".", 1)[-1]
    try:
        config = WorkerConfig.from_args(args, os.environ)
    except ValueError as err:
        print(f"pdserve {name}: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    warn_if_unsigned(config.kv_mac_key)
    # Before the engine and the servers start threads.
    thread_policy.apply(thread_policy.resolve(config.process.service_threads, "normal"))  # why normal: resolve

    async def main() -> None:
        # Before the engine exists: it asks once, when built, whether the process traces.
        telemetry.configure(telemetry.service_label([service_name]), config.process.traces)
        worker = make_worker(args, config)  # inside the loop: the kvstore channel binds to it
        servicers: list[object] = []
        server, port = await start_server(config.bind, lambda s: servicers.append(add_servicer(worker, s)),
                                          [service_name], process=config.process)
        report_engine_failure(worker, server)
        log.info("%s %s listening on port %d", service_name, worker.worker_id, port)
        drain = getattr(servicers[0], "drain", None)
        try:
            await serve_until_signal(server, drain=None if drain is None else
                                     lambda: drain.run(config.drain_timeout_s))
        finally:
            await worker.kv.close()
            worker.aengine.stop()

    asyncio.run(main())
    return 0
