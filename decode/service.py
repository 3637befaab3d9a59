"""The DecodeWorker gRPC servicer.

Prepare(hint) starts moving KV that already exists (see decode.prefetch for the signals).
Decode(request): gather the prompt's blocks (paged cache here, prefetched, or fetched now), hand
them to the engine, which shares or copies them into its paged cache (or recomputes the prompt
when a block is missing or corrupt), unpin the request's blocks in the KV store, then stream the
tokens of the continuous batch. A cancelled call aborts the sequence, which frees its blocks.

When a sequence finishes (stop or length), its full blocks past the prompt (generated tokens)
are written back to the kvstore, unpinned, in the background: the next turn of the conversation,
whose prompt starts with this one's prompt and answer, finds them by prefix lookup on any worker.

A background task reports the paged cache's full blocks to the kvstore's residency index (about
once a second, as deltas) so the gateway can route a prompt to the worker that holds its prefix.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import grpc

from decode.prefetch import BlockPrefetcher
from pdserve.grpc_server import abort_on
from pdserve.kvwire import encode_block
from pdserve.proto_convert import logprobs_to_proto, sampling_from_proto
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.kv_transfer import export_cached_blocks, resident_hashes
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, Worker, record_transfer

SERVICE_NAME = "pdserve.v1.DecodeWorker"
log = logging.getLogger(__name__)

WRITE_BACK_ENV = "PDSERVE_KV_WRITE_BACK"  # "0" turns write-back of finished sequences off
RESIDENCY_INTERVAL_ENV = "PDSERVE_RESIDENCY_INTERVAL_S"


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: Worker, write_back: bool | None = None,
                 residency_interval_s: float | None = None) -> None:
        self.worker = worker
        self.prefetcher = BlockPrefetcher(worker)
        self.write_back = os.environ.get(WRITE_BACK_ENV, "1") != "0" if write_back is None else write_back
        interval = residency_interval_s or float(os.environ.get(RESIDENCY_INTERVAL_ENV, "1.0"))
        self._tasks: set[asyncio.Task] = set()
        self._reporter = asyncio.get_running_loop().create_task(self._report_residency_forever(interval))

    async def Prepare(self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrepareResponse:
        try:
            local, fetching = self.prefetcher.prefetch(list(request.block_hashes), request.signal or "dispatch")
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return worker_pb2.PrepareResponse(blocks_local=local, blocks_fetching=fetching)

    @abort_on(WORKER_ERROR_CODES)
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid, prompt, hashes = request.request_id, list(request.prompt_token_ids), list(request.block_hashes)
        if not rid:
            raise ValueError("request_id is empty: the gateway names every request")
        params = sampling_from_proto(request.sampling)
        imported = False
        generated: list[int] = []
        try:
            blocks = await self.prefetcher.gather(rid, hashes)
            add = lambda e: e.add_prefilled(rid, prompt, request.first_token, params, hashes, blocks)  # noqa: E731
            async for outs in self.worker.aengine.generate(rid, add):
                if not imported:
                    imported = True
                    self._spawn(self.worker.kv.release(rid, drop=False))  # the KV is in our cache now
                generated += [t for o in outs for t in o.new_token_ids]
                reason = outs[-1].finish_reason
                if reason in ("stop", "length") and self.write_back:
                    self._spawn(self._write_back(rid, prompt + [request.first_token] + generated))
                yield worker_pb2.DecodeChunk(token_ids=[t for o in outs for t in o.new_token_ids],
                                             logprobs=logprobs_to_proto(lp for o in outs for lp in o.logprobs),
                                             finish_reason=reason)
        finally:
            if not imported:
                self._spawn(self.worker.kv.release(rid, drop=True))

    async def _write_back(self, rid: str, tokens: list[int]) -> None:
        """Put the finished sequence's full blocks past its prompt into the kvstore (unpinned)."""
        spec = self.worker.spec
        bm = self.worker.engine.block_manager
        # The last sampled token was never run through the model: it has no KV.
        chain = prompt_block_hashes(tokens[:-1], spec.block_size, spec.fingerprint, bm.kv_dtype)
        try:
            present = await self.worker.kv.presence(chain)
            new = [h for h, p in zip(chain, present) if not p]
            if not new:
                return
            blocks = await self.worker.aengine.call(lambda e: export_cached_blocks(e, new))
            encoded = await asyncio.to_thread(
                lambda: [(b.hash, encode_block(b.data, spec, b.num_tokens)) for b in blocks])
            start = time.perf_counter()
            await self.worker.kv.put_blocks("", encoded)
            nbytes = sum(len(d) for _, d in encoded)
            self.worker.counters.kv_bytes_sent += nbytes
            record_transfer(self.worker, "put", nbytes, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - write-back only helps later requests
            log.warning("write-back of %s failed: %s", rid, exc)

    async def _report_residency_forever(self, interval_s: float) -> None:
        reported: set[bytes] | None = None  # None: the kvstore needs a full report
        while True:
            try:
                current = await self.worker.aengine.call(resident_hashes)
                if reported is not None:
                    self.prefetcher.evicted(reported - current)
                reported = await self._report(current, reported)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - routing hints only; retry next round
                log.debug("residency report failed: %s", exc)
                reported = None
            await asyncio.sleep(interval_s)

    async def _report(self, current: set[bytes], reported: set[bytes] | None) -> set[bytes]:
        kv, wid = self.worker.kv, self.worker.worker_id
        if reported is None:
            await kv.report_residency(wid, current, (), reset=True)
            return current
        added, removed = current - reported, reported - current
        if await kv.report_residency(wid, added, removed, reset=False):  # the store forgot us
            await kv.report_residency(wid, current, (), reset=True)
        return current

    def _spawn(self, coro) -> None:
        # A task of its own: it must run even when this call is being cancelled.
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


def add_to_server(worker: Worker, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), server)
