"""The PrefillWorker gRPC servicer.

One Prefill call: the prompt joins the engine's next step together with other concurrent
prompts (token budget per step, long prompts in chunks); when its last chunk is computed
the first token is sampled; the prompt's KV blocks are exported, wire-encoded and streamed
to the KV store under a lease named by the request id; the reply carries the first token
and the block hashes the decode worker will ask for.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.grpc_server import abort_on
from pdserve.kvwire import encode_block
from pdserve.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.runtime.engine import Engine, StepOutput
from pdserve.runtime.kv_transfer import ExportedBlock
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, Worker

SERVICE_NAME = "pdserve.v1.PrefillWorker"


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    @abort_on(WORKER_ERROR_CODES)
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillResponse:
        rid, prompt = request.request_id, list(request.token_ids)
        if not rid:
            raise ValueError("request_id is empty: the gateway names every request")
        params = sampling_from_proto(request.sampling)
        last: StepOutput | None = None
        add = lambda e: e.add_request(rid, prompt, params, hold_blocks=True)  # noqa: E731
        async for outs in self.worker.aengine.generate(rid, add):
            last = outs[-1]
        blocks = await self.worker.aengine.call(lambda e: _export_and_release(e, rid))
        try:
            await self._store(rid, blocks)
        except BaseException:
            await self.worker.kv.release(rid, drop=True)
            raise
        if last.finish_reason:  # no decode will come for this request: unpin its blocks now
            await self.worker.kv.release(rid)
        lp = last.logprobs[0] if last.logprobs else None
        return worker_pb2.PrefillResponse(
            request_id=rid, first_token=last.new_token_ids[0],
            first_logprob=logprob_to_proto(lp) if lp else None,
            block_hashes=[b.hash for b in blocks], prompt_tokens=len(prompt),
            cached_tokens=last.cached_tokens, finish_reason=last.finish_reason)

    async def _store(self, rid: str, blocks: list[ExportedBlock]) -> None:
        spec = self.worker.spec
        encoded = await asyncio.to_thread(
            lambda: [(b.hash, encode_block(b.data, spec, b.num_tokens)) for b in blocks])
        result = await self.worker.kv.put_blocks(rid, encoded)
        if result.rejected:
            raise RuntimeError(f"kvstore rejected {result.rejected} of {len(encoded)} KV blocks (full?)")
        self.worker.counters.kv_bytes_sent += sum(len(d) for _, d in encoded)

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


def _export_and_release(engine: Engine, request_id: str) -> list[ExportedBlock]:
    try:
        return engine.export_held(request_id)
    finally:
        engine.release_held(request_id)


def add_to_server(worker: Worker, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(worker), server)
