"""The PrefillWorker gRPC servicer.

One Prefill call: the leading blocks the kvstore already holds (`cached_blocks`, from the
gateway's Lookup) are fetched under the request's lease and imported into the new sequence, so
only the rest of the prompt is computed (blocks this worker's own paged cache holds are shared
without fetching). The prompt then joins the engine's next step together with other concurrent
prompts (token budget per step, long prompts in chunks); when its last chunk is computed the
first token is sampled; the prompt's blocks that the kvstore does not hold yet are exported,
wire-encoded and streamed to the kvstore under a lease named by the request id; the reply
carries the first token, the block hashes the decode worker will ask for, and the prompt tokens
whose KV was reused (`cached_tokens`).

A prefix fetch that fails (kvstore down, corrupt block) only costs compute: the engine then
computes those tokens itself. A put that fails (kvstore down or full) does not fail the request
either: the decode worker finds the blocks missing and computes them (logged once per outage).

Prefill is idempotent by request id (prefill.single_flight): a retry that arrives while the same
request runs here joins that run instead of starting a second one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from pdserve.grpc_server import abort_on
from pdserve.kvwire import KVBlockError, decode_block
from pdserve.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine, StepOutput
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, Worker, put_blocks, record_transfer
from prefill.single_flight import SingleFlight

SERVICE_NAME = "pdserve.v1.PrefillWorker"
log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.flights: SingleFlight[worker_pb2.PrefillResponse] = SingleFlight()

    @abort_on(WORKER_ERROR_CODES)
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillResponse:
        if not request.request_id:
            raise ValueError("request_id is empty: the gateway names every request")
        return await self.flights.run(request.request_id, lambda: self._prefill(request))

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        rid, prompt = request.request_id, list(request.token_ids)
        params = sampling_from_proto(request.sampling)
        prefix = await self._fetch_prefix(rid, prompt, request.cached_blocks)
        last: StepOutput | None = None
        add = lambda e: e.add_with_prefix(rid, prompt, params, prefix, hold_blocks=True)  # noqa: E731
        try:
            async for outs in self.worker.aengine.generate(rid, add):
                last = outs[-1]
            blocks = await self.worker.aengine.call(lambda e: _export_and_release(e, rid))
        except BaseException:
            await self._release(rid, drop=True)
            raise
        # The fetched prefix is in the kvstore already, pinned under this lease by the fetch.
        await self._store(rid, [b for b in blocks if b.hash not in prefix])
        if last.finish_reason:  # no decode will come for this request: unpin its blocks now
            await self._release(rid, drop=False)
        lp = last.logprobs[0] if last.logprobs else None
        return worker_pb2.PrefillResponse(
            request_id=rid, first_token=last.new_token_ids[0],
            first_logprob=logprob_to_proto(lp) if lp else None,
            block_hashes=[b.hash for b in blocks], prompt_tokens=len(prompt),
            cached_tokens=last.cached_tokens, finish_reason=last.finish_reason)

    async def _fetch_prefix(self, rid: str, prompt: list[int], cached_blocks: int) -> dict[bytes, torch.Tensor]:
        """The decoded leading blocks worth importing: hinted by the gateway, not local already."""
        spec, bm = self.worker.spec, self.worker.engine.block_manager
        usable = min(max(cached_blocks, 0), (len(prompt) - 1) // spec.block_size)
        if usable <= 0:
            return {}
        hashes = prompt_block_hashes(prompt, spec.block_size, spec.fingerprint, bm.kv_dtype)[:usable]
        # A racy read of the engine's cache, but only to save transfers: the engine re-checks.
        wanted = [h for h in hashes if bm.lookup(h) is None]
        if not wanted:
            return {}
        try:
            start = time.perf_counter()
            datas = await self.worker.kv.get_blocks(wanted, request_id=rid)
            record_transfer(self.worker, "get", sum(len(d) for d in datas if d), time.perf_counter() - start)
        except grpc.aio.AioRpcError as err:
            log.warning("prefix fetch of %d blocks for %s failed (%s): computing them", len(wanted), rid,
                        err.code().name)
            return {}
        return await asyncio.to_thread(_decode_leading, wanted, datas, spec)

    async def _store(self, rid: str, blocks: list[ExportedBlock]) -> None:
        """Put the blocks under the lease `rid`; a failed put costs the decode worker a recompute
        of what is missing, never the request."""
        try:
            result = await put_blocks(self.worker, rid, blocks)
        except grpc.aio.AioRpcError as err:
            self.worker.kv_outage.failed(f"put of {len(blocks)} blocks for {rid}", err)
            return
        self.worker.kv_outage.ok()
        if result.rejected:
            log.warning("kvstore rejected %d of %d KV blocks of %s (full?): the decode worker will compute them",
                        result.rejected, len(blocks), rid)

    async def _release(self, rid: str, drop: bool) -> None:
        try:
            await self.worker.kv.release(rid, drop=drop)
        except grpc.aio.AioRpcError as err:  # the lease expires by itself in the store
            self.worker.kv_outage.failed(f"release of {rid}", err)

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


def _decode_leading(hashes: list[bytes], datas: list[bytes | None], spec) -> dict[bytes, torch.Tensor]:
    """Decoded blocks up to the first missing or bad one (a prefix needs every block before it)."""
    out: dict[bytes, torch.Tensor] = {}
    for h, data in zip(hashes, datas):
        if data is None:
            break
        try:
            out[h], _ = decode_block(data, spec)
        except KVBlockError as exc:
            log.warning("prefix block %s rejected (%s): computing from there", h.hex()[:12], exc)
            break
    return out


def _export_and_release(engine: Engine, request_id: str) -> list[ExportedBlock]:
    try:
        return engine.export_held(request_id)
    finally:
        engine.release_held(request_id)


def add_to_server(worker: Worker, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), server)
