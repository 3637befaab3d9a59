"""gRPC servicer of pdserve.v1.KVStore: converts protobuf messages to TieredStore calls.

Blocks travel one per message in both directions (PutBlocks client-streaming, GetBlocks
server-streaming) so bulk transfers never build one giant message. The service treats block
data as opaque bytes; it only checks the wire header's magic, version and length so that garbage
is refused at the door (readers still verify the checksum and the model fingerprint).

A client on the store's host may attach a staging segment of shared memory (AttachSegment,
kvstore.shared_memory): its puts then name a range of the segment instead of carrying the bytes,
and its gets hand the store a range to fill. A segment the store cannot use (not on this host,
wrong token, a range outside it) fails the call with FAILED_PRECONDITION, and the client goes
back to sending bytes inside messages.

It also keeps the ResidencyIndex (which decode worker holds which blocks in its paged cache):
decode workers report into it, and Lookup(with_residency) reads it for the gateway's router.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc

from kvstore.residency import ResidencyIndex
from kvstore.shared_memory import AttachedSegments, SegmentError
from kvstore.store import MemoryBlockStore, PutOutcome, StoreFullError
from kvstore.tiered import TieredStore
from pdserve.grpc_server import ServiceError, abort_on
from pdserve.kv_header import HEADER_SIZE, KVBlockError, read_header
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


def check_block_data(data: bytes) -> None:
    """Raise KVBlockError unless `data` has a valid wire header and exactly its payload length."""
    header = read_header(data)
    if len(data) != HEADER_SIZE + header.payload_len:
        raise KVBlockError(
            f"block is {len(data)} bytes, header says {HEADER_SIZE + header.payload_len}")


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Serves one TieredStore (a bare MemoryBlockStore is wrapped: memory tier only)."""

    def __init__(self, store: TieredStore | MemoryBlockStore, residency: ResidencyIndex | None = None,
                 segments: AttachedSegments | None = None) -> None:
        self.store = store if isinstance(store, TieredStore) else TieredStore(store)
        self.residency = residency or ResidencyIndex()
        self.segments = segments or AttachedSegments()

    @abort_on()
    async def AttachSegment(self, request: kvstore_pb2.SharedSegment,
                            context: grpc.aio.ServicerContext) -> kvstore_pb2.AttachSegmentResponse:
        try:
            self.segments.attach(request.name, request.token)
        except SegmentError as exc:
            return kvstore_pb2.AttachSegmentResponse(attached=False, reason=str(exc))
        return kvstore_pb2.AttachSegmentResponse(attached=True)

    @abort_on()
    async def PutBlocks(self, request_iterator: AsyncIterator[kvstore_pb2.PutBlockRequest],
                        context: grpc.aio.ServicerContext) -> kvstore_pb2.PutBlocksResponse:
        response = kvstore_pb2.PutBlocksResponse()
        async for request in request_iterator:
            outcome = self._put_one(request)
            if outcome is PutOutcome.STORED:
                response.stored += 1
            elif outcome is PutOutcome.ALREADY_PRESENT:
                response.already_present += 1
            else:
                response.rejected += 1
        return response

    def _put_one(self, request: kvstore_pb2.PutBlockRequest) -> PutOutcome | None:
        """Store one block; None when it is rejected (the stream goes on with the next one)."""
        data = self._data_of(request)
        try:
            if not request.block_hash:
                raise KVBlockError("empty block_hash")
            check_block_data(data)
            return self.store.put(request.block_hash, data, lease=request.request_id)
        except KVBlockError as exc:
            log.warning("rejected block %s of %r: %s", request.block_hash.hex(), request.request_id, exc)
        except StoreFullError as exc:
            log.warning("rejected block %s of %r: %s", request.block_hash.hex(), request.request_id, exc)
        return None

    def _data_of(self, request: kvstore_pb2.PutBlockRequest) -> bytes:
        """The block's bytes: inline, or copied out of the sender's segment."""
        if not request.HasField("segment"):
            return request.data
        segment = request.segment
        try:
            return self.segments.read(segment.name, segment.token, request.offset, request.length)
        except SegmentError as exc:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None

    @abort_on()
    async def GetBlocks(self, request: kvstore_pb2.GetBlocksRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[kvstore_pb2.KVBlock]:
        # Fetch (and pin) everything up front: the bytes are immutable, so later evictions
        # cannot change what this stream sends.
        found = await self.store.get(list(request.block_hashes), lease=request.request_id)
        staging = request.segment if request.HasField("segment") else None
        cursor, end = request.offset, request.offset + request.capacity
        for block_hash, data in zip(request.block_hashes, found):
            if data is None:
                yield kvstore_pb2.KVBlock(block_hash=block_hash, missing=True)
            elif staging is not None and cursor + len(data) <= end:
                try:
                    self.segments.write(staging.name, staging.token, cursor, data)
                except SegmentError as exc:
                    raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
                yield kvstore_pb2.KVBlock(block_hash=block_hash, in_segment=True, offset=cursor, length=len(data))
                cursor += len(data)
            else:
                yield kvstore_pb2.KVBlock(block_hash=block_hash, data=data)

    @abort_on()
    async def Lookup(self, request: kvstore_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvstore_pb2.LookupResponse:
        hashes = list(request.block_hashes)
        present = await self.store.presence(hashes)
        prefix = next((i for i, p in enumerate(present) if not p), len(present))
        response = kvstore_pb2.LookupResponse(prefix_blocks=prefix, present=present)
        if request.with_residency:
            response.residency.extend(kvstore_pb2.WorkerPrefix(worker_id=w, prefix_blocks=n)
                                      for w, n in self.residency.prefixes(hashes))
        return response

    @abort_on()
    async def ReportResidency(self, request: kvstore_pb2.ResidencyReport,
                              context: grpc.aio.ServicerContext) -> kvstore_pb2.ResidencyAck:
        need_reset = self.residency.report(request.worker_id, request.added, request.removed, request.reset)
        return kvstore_pb2.ResidencyAck(need_reset=need_reset)

    @abort_on()
    async def Release(self, request: kvstore_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.ReleaseResponse:
        if not request.request_id:
            raise ValueError("request_id is required")
        return kvstore_pb2.ReleaseResponse(released=self.store.release(request.request_id, request.drop))

    @abort_on()
    async def Stats(self, request: kvstore_pb2.KVStoreStatsRequest,
                    context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStoreStats:
        return kvstore_pb2.KVStoreStats(**dataclasses.asdict(self.store.stats()))


def add_to_server(store: TieredStore | MemoryBlockStore, server: grpc.aio.Server) -> KVStoreServicer:
    """Register a servicer of `store` on `server` and return it."""
    servicer = KVStoreServicer(store)
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)
    return servicer
