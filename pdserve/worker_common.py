"""What prefill and decode workers share: flags, engine start-up, error codes, stats."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvstore.client import KVStoreClient, PutResult
from pdserve.engine_args import build_engine
from pdserve.grpc_server import DEFAULT_ERROR_CODES, check_security_settings, serve_until_signal, start_server
from pdserve.kvwire import BlockSpec, encode_block
from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError
from pdserve.runtime.engine import Engine, QueueFullError
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

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
    spec: BlockSpec
    counters: TransferCounters
    kv_outage: KVOutage = field(default_factory=KVOutage)

    @property
    def engine(self) -> Engine:
        return self.aengine.engine

    def stats(self) -> worker_pb2.WorkerStats:
        e, bm = self.engine, self.engine.block_manager
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_blocks, num_steps=e.stats.steps,
            max_batch_size=e.stats.max_batch_size, batch_size_counts=dict(e.stats.batch_size_counts),
            tokens_generated=e.stats.tokens_generated, kv_bytes_received=self.counters.kv_bytes_received,
            kv_bytes_sent=self.counters.kv_bytes_sent)


def record_transfer(worker: Worker, direction: str, nbytes: int, seconds: float) -> None:
    """Count one batched KV transfer ("put": to the kvstore, "get": from it) in the metrics."""
    from pdserve.worker_metrics import KV_TRANSFER_BYTES, KV_TRANSFER_SECONDS

    KV_TRANSFER_BYTES.labels(direction=direction).inc(nbytes)
    KV_TRANSFER_SECONDS.labels(direction=direction).observe(seconds)


async def put_blocks(worker: Worker, lease: str, blocks: Sequence[ExportedBlock]) -> PutResult:
    """Wire-encode exported blocks (off the loop) and put them into the kvstore under `lease` ("":
    unpinned), counting the bytes sent. Raises grpc.aio.AioRpcError when the store fails."""
    spec = worker.spec
    encoded = await asyncio.to_thread(lambda: [(b.hash, encode_block(b.data, spec, b.num_tokens)) for b in blocks])
    start = time.perf_counter()
    result = await worker.kv.put_blocks(lease, encoded)
    nbytes = sum(len(d) for _, d in encoded)
    worker.counters.kv_bytes_sent += nbytes
    record_transfer(worker, "put", nbytes, time.perf_counter() - start)
    return result


def block_spec(engine: Engine) -> BlockSpec:
    c = engine.model_config
    return BlockSpec(engine.fingerprint, engine.kv_cache.dtype, c.num_layers, c.num_kv_heads, c.head_dim,
                     engine.block_manager.block_size)


def make_worker(args: argparse.Namespace) -> Worker:
    engine, _ = build_engine(args)
    aengine = AsyncEngine(engine, batch_window_s=args.batch_window_ms / 1000,
                          max_streams=args.max_waiting + args.max_batch_size).start()
    worker_id = args.worker_id or f"{socket.gethostname()}:{args.bind.rsplit(':', 1)[-1]}"
    kv = KVStoreClient(args.kvstore, timeout_s=KVSTORE_TIMEOUT_S)
    return Worker(worker_id, aengine, kv, block_spec(engine), TransferCounters())


def run_worker(args: argparse.Namespace, service_name: str,
               add_servicer: Callable[[Worker, grpc.aio.Server], None]) -> int:
    """Builds the worker, serves until SIGINT/SIGTERM, then stops cleanly."""
    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {service_name.rsplit('.', 1)[-1]} %(levelname)s %(message)s")
    try:
        check_security_settings()
    except ValueError as err:
        print(f"pdserve {service_name.rsplit('.', 1)[-1]}: {err}", file=sys.stderr)
        return 2

    async def main() -> None:
        worker = make_worker(args)  # inside the loop: the kvstore channel binds to it
        server, port = await start_server(args.bind, lambda s: add_servicer(worker, s), [service_name])
        log.info("%s %s listening on port %d", service_name, worker.worker_id, port)
        try:
            await serve_until_signal(server)
        finally:
            await worker.kv.close()
            worker.aengine.stop()

    asyncio.run(main())
    return 0
