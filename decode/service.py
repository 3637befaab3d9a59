"""The DecodeWorker gRPC servicer.

Prepare(hint) starts moving KV that already exists. Decode(request): gather the prompt's
blocks (paged cache here, staged by a hint, or fetched now), hand them to the engine,
which shares or copies them into its paged cache (or recomputes the prompt when a block is
missing or corrupt), unpin the request's blocks in the KV store, then stream the tokens of
the continuous batch. A cancelled call aborts the sequence, which frees its blocks.
"""

from __future__ import annotations

import asyncio

import grpc

from decode.prefetch import BlockPrefetcher
from pdserve.grpc_server import abort_on
from pdserve.proto_convert import logprobs_to_proto, sampling_from_proto
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, Worker

SERVICE_NAME = "pdserve.v1.DecodeWorker"


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.prefetcher = BlockPrefetcher(worker)

    async def Prepare(self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrepareResponse:
        local, fetching = self.prefetcher.prefetch(list(request.block_hashes))
        return worker_pb2.PrepareResponse(blocks_local=local, blocks_fetching=fetching)

    @abort_on(WORKER_ERROR_CODES)
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid, prompt, hashes = request.request_id, list(request.prompt_token_ids), list(request.block_hashes)
        if not rid:
            raise ValueError("request_id is empty: the gateway names every request")
        params = sampling_from_proto(request.sampling)
        imported = False
        try:
            blocks = await self.prefetcher.gather(rid, hashes)
            add = lambda e: e.add_prefilled(rid, prompt, request.first_token, params, hashes, blocks)  # noqa: E731
            async for outs in self.worker.aengine.generate(rid, add):
                if not imported:
                    imported = True
                    self._unpin(rid, drop=False)  # the KV is in our cache now
                yield worker_pb2.DecodeChunk(token_ids=[t for o in outs for t in o.new_token_ids],
                                             logprobs=logprobs_to_proto(lp for o in outs for lp in o.logprobs),
                                             finish_reason=outs[-1].finish_reason)
        finally:
            if not imported:
                self._unpin(rid, drop=True)

    def _unpin(self, rid: str, drop: bool) -> None:
        # A task of its own: it must run even when this call is being cancelled.
        asyncio.ensure_future(self.worker.kv.release(rid, drop=drop))

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


def add_to_server(worker: Worker, server: grpc.aio.Server) -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(worker), server)
