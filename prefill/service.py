"""The PrefillWorker gRPC servicer.

One Prefill call: the leading blocks the kvstore already holds (`cached_blocks`, from the
gateway's Lookup) are fetched under the request's lease and imported into the new sequence, so
only the rest of the prompt is computed (blocks this worker's own paged cache holds are shared
without fetching, among them those a session Prepare brought here before the turn arrived:
pdserve.block_prefetch, counted in pdserve_prefill_blocks_total{source}). The prompt then joins the engine's next step together with other concurrent
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

Ownership (a cancel can land on any await): the references pinned on cached prefix blocks belong
to a `PinnedBlocks`, released exactly once on the engine thread (by the add, or by the cleanup);
a held sequence's blocks are released by the export, or by the abort of a request left early; the
kvstore lease belongs to a `RequestLease`, ended once after its calls finished (drop on failure,
at once when the request finished here, else by the decode worker that reads the blocks).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from pdserve.block_prefetch import PREFILL_BLOCKS, BlockPrefetcher, answer_prepare
from pdserve.grpc_server import abort_on
from pdserve.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine, StepOutput
from pdserve.runtime.kv_transfer import ExportedBlock, PinnedBlocks
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, RequestLease, Worker, put_blocks
from prefill.single_flight import SingleFlight

SERVICE_NAME = "pdserve.v1.PrefillWorker"
PREFETCH_HOLD_S = 10.0  # how long a session prefetch stays pinned waiting for its turn
HOLD_SWEEP_S = 0.5
log = logging.getLogger(__name__)


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.flights: SingleFlight[worker_pb2.PrefillResponse] = SingleFlight()
        # Dispatch staging is a decode worker's business: a Prefill fetches its prefix at once.
        # Session blocks are held against eviction until their turn uses them, for at most
        # PREFETCH_HOLD_S (a turn later than that was mispredicted: the blocks become evictable).
        self.prefetcher = BlockPrefetcher(worker, blocks_counter=PREFILL_BLOCKS, signals=("session", "hot"),
                                          hold_s=PREFETCH_HOLD_S)
        self._expiry = asyncio.get_running_loop().create_task(self._expire_holds_forever())

    async def _expire_holds_forever(self) -> None:
        while True:
            await asyncio.sleep(HOLD_SWEEP_S)
            try:
                await self.prefetcher.expire_holds()
                self.prefetcher.sweep_evicted()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine may be stopping; try next round
                log.debug("prefetch hold sweep failed: %s", exc)

    async def Prepare(self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrepareResponse:
        return await answer_prepare(self.prefetcher, request, context, "session")

    @abort_on(WORKER_ERROR_CODES)
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillResponse:
        if not request.request_id:
            raise ValueError("request_id is empty: the gateway names every request")
        return await self.flights.run(request.request_id, lambda: self._prefill(request))

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        rid, prompt = request.request_id, list(request.token_ids)
        params = sampling_from_proto(request.sampling)
        stored = self._stored_prefix(prompt, request.cached_blocks)
        # One owner each, released once on every path (also a cancel at any await): the references
        # on what the paged cache holds now (a session prefetch put it there: another prompt's
        # step could evict it while we fetch the rest) go to the sequence when it is added, or
        # back in `finally`; the kvstore lease ends here unless a decode worker takes it over.
        pins, lease = PinnedBlocks(stored), RequestLease(self.worker, rid)
        succeeded = False
        try:
            await self._make_room(prompt, stored)
            await self.worker.aengine.call(pins.pin)
            prefix = await lease.run(self._fetch_prefix(rid, stored))
            last, blocks = await self._compute(rid, prompt, params, prefix, pins, set(stored))
            # The store holds the hinted prefix already (what was fetched is pinned under this
            # lease); putting it again would cost the whole history's KV on every turn of a chat.
            await lease.run(self._store(rid, blocks))
            succeeded = True
        finally:
            self.worker.aengine.call_soon(pins.release)  # a no-op once the sequence took them
            if not succeeded:
                lease.end(drop=True)
        if last.finish_reason:  # no decode will come for this request: unpin its blocks now
            await asyncio.shield(lease.end(drop=False))
        lp = last.logprobs[0] if last.logprobs else None
        return worker_pb2.PrefillResponse(
            request_id=rid, first_token=last.new_token_ids[0],
            first_logprob=logprob_to_proto(lp) if lp else None,
            block_hashes=[*stored, *(b.hash for b in blocks)], prompt_tokens=len(prompt),
            cached_tokens=last.cached_tokens, finish_reason=last.finish_reason)

    async def _make_room(self, prompt: list[int], stored: list[bytes]) -> None:
        """Unpins session prefetches (not this request's own) until the prompt's new blocks fit."""
        bm = self.worker.engine.block_manager
        new_blocks = -(-len(prompt) // self.worker.spec.block_size) - sum(bm.lookup(h) is not None for h in stored)
        await self.prefetcher.make_room(new_blocks, keep=set(stored))

    async def _compute(self, rid: str, prompt: list[int], params: SamplingParams, prefix: dict[bytes, torch.Tensor],
                       pins: PinnedBlocks, skip: set[bytes]) -> tuple[StepOutput, list[ExportedBlock]]:
        """Runs the prompt in the engine; its last output and its blocks but `skip`, exported (the
        engine releases them: a cancel at the export's await cannot keep them held)."""
        def add(engine: Engine) -> None:
            try:
                engine.add_with_prefix(rid, prompt, params, prefix, hold_blocks=True)
            finally:
                pins.release(engine)  # the sequence holds its own references now
        last: StepOutput | None = None
        async for outs in self.worker.aengine.generate(rid, add):  # leaving early aborts it
            last = outs[-1]
        blocks = await self.worker.aengine.call(lambda e: _export_and_release(e, rid, skip))
        return last, blocks

    def _stored_prefix(self, prompt: list[int], cached_blocks: int) -> list[bytes]:
        """Hashes of the leading blocks the gateway found in the kvstore that may be reused (the
        block holding the last prompt token is always computed: its logits pick the first token)."""
        spec, bm = self.worker.spec, self.worker.engine.block_manager
        usable = min(max(cached_blocks, 0), (len(prompt) - 1) // spec.block_size)
        if usable <= 0:
            return []
        return prompt_block_hashes(prompt, spec.block_size, spec.fingerprint, bm.kv_dtype)[:usable]

    async def _fetch_prefix(self, rid: str, hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The decoded leading blocks of `hashes` that are not local already (a prefetch in
        flight for them is awaited instead of fetching twice)."""
        if not hashes:
            return {}
        # A racy read of the engine's cache, but only to save transfers: the engine re-checks.
        blocks = await self.prefetcher.gather(rid, hashes)
        return _leading(hashes, blocks, self.worker.engine.block_manager)

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

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


def _leading(hashes: list[bytes], blocks: dict[bytes, torch.Tensor], bm) -> dict[bytes, torch.Tensor]:
    """The fetched blocks up to the first one neither fetched nor local (a prefix needs every
    block before it; the engine computes from there)."""
    out: dict[bytes, torch.Tensor] = {}
    for h in hashes:
        if h in blocks:
            out[h] = blocks[h]
        elif bm.lookup(h) is None:
            break
    return out


def _export_and_release(engine: Engine, request_id: str, skip: set[bytes]) -> list[ExportedBlock]:
    try:
        return engine.export_held(request_id, skip)
    finally:
        engine.release_held(request_id)


def add_to_server(worker: Worker, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), server)
