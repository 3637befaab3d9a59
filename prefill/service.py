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

Structured output (`SamplingParams.structured`): the engine compiles the spec against this model's
vocabulary (cached by spec) and samples the first token under its grammar; a spec it cannot
compile (a token id the vocabulary lacks) is INVALID_ARGUMENT. When that token completes the
grammar the reply's finish_reason is "stop" and no decode follows.

Draining (SIGTERM; pdserve.drain): new Prefill calls are refused with UNAVAILABLE (the gateway
retries them on another prefill worker, or prefills on the decode worker), running ones finish
(a prefill is short); one still running at the drain deadline ends with UNAVAILABLE and is retried
the same way.

Ownership (a cancel can land on any await): the engine owns every block reference. The prefix
blocks resident here when the Prefill starts are pinned under the request's id: its sequence takes
them over when the scheduler admits it, and the `unpin` on every way out drops them if it never
was (a no-op otherwise). A held sequence's blocks are released by `export_held`, or by the abort
of a request left early. The kvstore lease belongs to a `RequestLease`, ended once after its calls
finished (drop on failure, at once when the request finished here, else by the decode worker that
reads the blocks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import torch

from pdserve.block_prefetch import PREFILL_BLOCKS, BlockPrefetcher, answer_prepare
from pdserve.drain import Drain
from pdserve.grpc_server import abort_on
from pdserve.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.runtime.engine import AddRequest, StepOutput
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.runtime.pins import request_owner
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
        self.drain = Drain(f"prefill worker {worker.worker_id}")
        self._sweep = asyncio.get_running_loop().create_task(self._sweep_evicted_forever())

    async def _sweep_evicted_forever(self) -> None:
        # The engine expires the holds itself; this only counts the prefetches that went unused.
        while True:
            await asyncio.sleep(HOLD_SWEEP_S)
            self.prefetcher.sweep_evicted()

    async def Prepare(self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrepareResponse:
        if self.drain.draining:  # a hint: nothing is worth moving to a worker that is leaving
            return worker_pb2.PrepareResponse()
        return await answer_prepare(self.prefetcher, request, context, "session")

    @abort_on(WORKER_ERROR_CODES)
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillResponse:
        if not request.request_id:
            raise ValueError("request_id is empty: the gateway names every request")
        with self.drain.call():  # UNAVAILABLE at once while draining: the gateway goes elsewhere
            return await self.drain.unless_handed_over(self.flights.run(request.request_id,
                                                                        lambda: self._prefill(request)))

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        rid, prompt = request.request_id, list(request.token_ids)
        params = sampling_from_proto(request.sampling)
        stored = self._stored_prefix(prompt, request.cached_blocks)
        lease = RequestLease(self.worker, rid)
        aengine = self.worker.aengine
        succeeded = False
        try:
            # What the paged cache holds now (a session prefetch put it there) stays until the
            # sequence is admitted: another prompt's step could evict it while we fetch the rest.
            await aengine.pin(request_owner(rid), stored)
            prefix = await lease.run(self._fetch_prefix(rid, stored))
            last, blocks = await self._compute(AddRequest(rid, prompt, params, blocks=prefix, hold_blocks=True),
                                               set(stored))
            # The store holds the hinted prefix already (what was fetched is pinned under this
            # lease); putting it again would cost the whole history's KV on every turn of a chat.
            await lease.run(self._store(rid, blocks))
            succeeded = True
        finally:
            aengine.unpin(request_owner(rid))  # a no-op once the sequence took them
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

    async def _compute(self, request: AddRequest, skip: set[bytes]) -> tuple[StepOutput, list[ExportedBlock]]:
        """Runs the prompt in the engine; its last output and its blocks but `skip`, exported (the
        engine releases them: a cancel at the export's await cannot keep them held)."""
        last: StepOutput | None = None
        async for outs in self.worker.aengine.generate(request):  # leaving early aborts it
            last = outs[-1]
        blocks = await self.worker.aengine.export_held(request.request_id, skip)
        return last, blocks

    def _stored_prefix(self, prompt: list[int], cached_blocks: int) -> list[bytes]:
        """Hashes of the leading blocks the gateway found in the kvstore that may be reused."""
        usable = min(max(cached_blocks, 0), self.worker.kv_format.reusable_blocks(len(prompt)))
        return self.worker.kv_format.reusable_hashes(prompt)[:usable] if usable else []

    async def _fetch_prefix(self, rid: str, hashes: list[bytes]) -> dict[bytes, torch.Tensor]:
        """The decoded leading blocks of `hashes` that are not local already (a prefetch in
        flight for them is awaited instead of fetching twice)."""
        if not hashes:
            return {}
        # A racy read of the engine's cache, but only to save transfers: the engine re-checks.
        blocks = await self.prefetcher.gather(rid, hashes)
        return _leading(hashes, blocks, self.worker.aengine.is_resident)

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


def _leading(hashes: list[bytes], blocks: dict[bytes, torch.Tensor],
             is_resident: Callable[[bytes], bool]) -> dict[bytes, torch.Tensor]:
    """The fetched blocks up to the first one neither fetched nor local (a prefix needs every
    block before it; the engine computes from there)."""
    out: dict[bytes, torch.Tensor] = {}
    for h in hashes:
        if h in blocks:
            out[h] = blocks[h]
        elif not is_resident(h):
            break
    return out


def add_to_server(worker: Worker, server: grpc.aio.Server) -> PrefillServicer:
    """Serve a PrefillServicer of `worker` on `server`; the servicer (run_worker drains it on SIGTERM)."""
    servicer = PrefillServicer(worker)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
    return servicer
