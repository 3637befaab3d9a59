"""Async client of the KV store, used by the prefill and decode workers and the gateway.

Protobuf stays inside this module: callers pass and receive plain bytes, ints and dataclasses.
Failed calls raise grpc.aio.AioRpcError (e.g. UNAVAILABLE when the store is down).

With `shared_memory_bytes`, block data moves through a staging segment of shared memory when the
store runs on this host (kvstore.shared_memory), and inside the messages otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType

import grpc

from kvstore.shared_memory import DEFAULT_DIR, StagingSegment
from kvstore.store import StoreStats
from pdserve.grpc_server import grpc_channel
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


log = logging.getLogger(__name__)


class KVStoreProtocolError(RuntimeError):
    """The store answered something that breaks the contract (e.g. blocks out of order)."""


@dataclass(frozen=True, slots=True)
class PutResult:
    """Outcome of one put_blocks call."""

    stored: int
    already_present: int
    rejected: int


class KVStoreClient:
    """Talks to one KV store at `target` ("host:port"); use `async with` or call close()."""

    def __init__(self, target: str, timeout_s: float | None = None, shared_memory_bytes: int = 0,
                 shared_memory_dir: Path = DEFAULT_DIR) -> None:
        self.target = target
        self.timeout_s = timeout_s  # deadline of each call; None = no deadline
        self._channel = grpc_channel(target)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._staging = StagingLink(target, self._stub, shared_memory_bytes, shared_memory_dir, timeout_s)

    @property
    def shared_memory(self) -> bool:
        """Whether block data moves through shared memory (known after the first transfer)."""
        return self._staging.segment is not None

    @property
    def blocks_in_shared_memory(self) -> int:
        """Blocks put or got through the segment so far."""
        return self._staging.blocks_moved

    async def put_blocks(self, request_id: str, blocks: Iterable[tuple[bytes, bytes]]) -> PutResult:
        """Upload (hash, wire data) pairs in one stream, pinned under `request_id` ("" = unpinned)."""
        blocks = list(blocks)
        segment = await self._staging.ready()
        if segment is None:
            return await self._put(request_id, blocks, None)
        regions: list[tuple[int, int]] = []
        try:
            result = await self._put(request_id, blocks, (segment, regions))
        except grpc.aio.AioRpcError as exc:
            self._staging.retire(segment, regions)
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            self._staging.lost(exc.details())  # e.g. a store restarted elsewhere: send inline
            return await self._put(request_id, blocks, None)
        except BaseException:
            self._staging.retire(segment, regions)
            raise
        for offset, length in regions:
            segment.regions.free(offset, length)
        return result

    async def _put(self, request_id: str, blocks: list[tuple[bytes, bytes]],
                   staging: tuple[StagingSegment, list[tuple[int, int]]] | None) -> PutResult:
        """One PutBlocks stream; with `staging`, each block that finds room goes through the segment
        (its region appended to the list)."""
        named = segment_message(staging[0]) if staging else None

        async def requests() -> AsyncIterator[kvstore_pb2.PutBlockRequest]:
            for block_hash, data in blocks:
                offset = staging[0].regions.reserve(len(data)) if staging else None
                if offset is None:
                    self._staging.seen(len(data), staged=False)
                    yield kvstore_pb2.PutBlockRequest(request_id=request_id, block_hash=block_hash, data=data)
                    continue
                segment, regions = staging
                regions.append((offset, len(data)))
                self._staging.seen(len(data), staged=True)
                segment.write(offset, data)
                yield kvstore_pb2.PutBlockRequest(request_id=request_id, block_hash=block_hash,
                                                  segment=named, offset=offset, length=len(data))

        response = await self._stub.PutBlocks(requests(), timeout=self.timeout_s)
        return PutResult(response.stored, response.already_present, response.rejected)

    async def stream_blocks(self, hashes: Sequence[bytes], request_id: str = ""
                            ) -> AsyncIterator[tuple[bytes, bytes | None]]:
        """Yield (hash, data or None if missing) in request order as blocks arrive.

        A non-empty `request_id` pins the returned blocks under that lease.
        """
        request = kvstore_pb2.GetBlocksRequest(request_id=request_id, block_hashes=hashes)
        segment = await self._staging.ready()
        region = self._staging.reserve_for(segment, len(hashes)) if segment is not None else None
        if region is not None:
            request.segment.CopyFrom(segment_message(segment))
            request.offset, request.capacity = region
        call = self._stub.GetBlocks(request, timeout=self.timeout_s)
        count, ended = 0, False
        try:
            async for block in call:
                if count >= len(hashes) or block.block_hash != hashes[count]:
                    raise KVStoreProtocolError(f"GetBlocks answer {count} is not for the hash asked for")
                yield block.block_hash, self._block_data(block, segment, region)
                count += 1
            ended = True
        except grpc.aio.AioRpcError as exc:
            if region is not None and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._staging.lost(exc.details())  # the store cannot use the segment: inline from now on
            raise
        finally:
            call.cancel()  # no-op when finished; stops the transfer if the caller broke off early
            if region is not None and ended:
                segment.regions.free(*region)
            elif region is not None:  # the store may still be writing into it
                self._staging.retire(segment, [region])
        if count != len(hashes):
            raise KVStoreProtocolError(f"GetBlocks returned {count} of {len(hashes)} blocks")

    def _block_data(self, block: kvstore_pb2.KVBlock, segment: StagingSegment | None,
                    region: tuple[int, int] | None) -> bytes | None:
        if block.missing:
            return None
        if not block.in_segment:
            self._staging.seen(len(block.data), staged=False)
            return block.data
        offset, capacity = region or (0, 0)
        if not (segment and region and offset <= block.offset
                and block.offset + block.length <= offset + capacity):
            raise KVStoreProtocolError("GetBlocks placed a block outside the region it was given")
        self._staging.seen(block.length, staged=True)
        return segment.read(block.offset, block.length)

    async def get_blocks(self, hashes: Sequence[bytes], request_id: str = "") -> list[bytes | None]:
        """Data of each hash in order, None where the store does not have it."""
        hashes = list(hashes)
        return [data async for _, data in self.stream_blocks(hashes, request_id)]

    async def presence(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is stored."""
        response = await self._lookup(hashes)
        return list(response.present)

    async def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading hashes the store holds."""
        return (await self._lookup(hashes)).prefix_blocks

    async def lookup_residency(self, hashes: Sequence[bytes]) -> tuple[int, dict[str, int]]:
        """(leading hashes stored, {decode worker id: leading hashes in its paged cache})."""
        response = await self._lookup(hashes, with_residency=True)
        return response.prefix_blocks, {w.worker_id: w.prefix_blocks for w in response.residency}

    async def _lookup(self, hashes: Sequence[bytes], with_residency: bool = False) -> kvstore_pb2.LookupResponse:
        return await self._stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes, with_residency=with_residency),
                                       timeout=self.timeout_s)

    async def report_residency(self, worker_id: str, added: Iterable[bytes], removed: Iterable[bytes],
                               reset: bool) -> bool:
        """Tell the store which full blocks entered/left `worker_id`'s paged cache; True when the
        store asks for a full report (reset) next."""
        response = await self._stub.ReportResidency(kvstore_pb2.ResidencyReport(
            worker_id=worker_id, added=list(added), removed=list(removed), reset=reset), timeout=self.timeout_s)
        return response.need_reset

    async def release(self, request_id: str, drop: bool = False) -> int:
        """End the lease `request_id`; `drop` also deletes its unshared blocks. Returns blocks unpinned."""
        response = await self._stub.Release(
            kvstore_pb2.ReleaseRequest(request_id=request_id, drop=drop), timeout=self.timeout_s)
        return response.released

    async def stats(self) -> StoreStats:
        response = await self._stub.Stats(kvstore_pb2.KVStoreStatsRequest(), timeout=self.timeout_s)
        return StoreStats(**{f.name: getattr(response, f.name) for f in fields(StoreStats)})

    async def close(self) -> None:
        await self._channel.close()
        self._staging.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def segment_message(segment: StagingSegment) -> kvstore_pb2.SharedSegment:
    """The message naming `segment` to the store."""
    return kvstore_pb2.SharedSegment(name=segment.name, token=segment.token)


class StagingLink:
    """A client's staging segment (kvstore.shared_memory) and whether its store uses it: created and
    attached at the first transfer; off for good when the store cannot map it."""

    FIRST_BLOCK_GUESS = 512 * 1024  # bytes a block is taken to have until one has been seen

    def __init__(self, target: str, stub: kvstore_pb2_grpc.KVStoreStub, area_bytes: int, directory: Path,
                 timeout_s: float | None) -> None:
        self.target = target
        self._stub = stub
        self.area_bytes = area_bytes
        self.directory = directory
        self.timeout_s = timeout_s
        self.segment: StagingSegment | None = None
        self._off = area_bytes <= 0
        self._lock = asyncio.Lock()
        self._block_bytes = 0  # the largest block moved so far
        self.blocks_moved = 0  # through the segment, puts and gets

    async def ready(self) -> StagingSegment | None:
        """The attached segment, or None: block data goes inline."""
        if self.segment is None and not self._off:
            async with self._lock:
                if self.segment is None and not self._off:
                    await self._attach()
        return self.segment

    async def _attach(self) -> None:
        try:
            segment = StagingSegment(self.area_bytes, self.directory)
        except OSError as exc:
            self._turn_off(f"no staging segment in {self.directory}: {exc}")
            return
        try:
            response = await self._stub.AttachSegment(segment_message(segment), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            segment.close()
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a store from before shared memory
                self._turn_off("the store has no AttachSegment")
            return  # unreachable now: inline this time, try again next time
        if not response.attached:
            segment.close()
            self._turn_off(response.reason)
            return
        self.segment = segment
        log.info("KV blocks to and from %s go through shared memory (%s, %d MiB)",
                 self.target, segment.path, self.area_bytes >> 20)

    def reserve_for(self, segment: StagingSegment, blocks: int) -> tuple[int, int] | None:
        """A region for a get of `blocks` blocks (smaller when the area has less room, None when it has
        room for none): (offset, capacity)."""
        block = self._block_bytes or self.FIRST_BLOCK_GUESS
        length = min(blocks * block, segment.regions.largest_free())
        if length < block:
            return None
        return segment.regions.reserve(length), length

    def seen(self, block_bytes: int, staged: bool) -> None:
        """A block of `block_bytes` moved, through the segment or inline."""
        self._block_bytes = max(self._block_bytes, block_bytes)
        self.blocks_moved += staged

    def retire(self, segment: StagingSegment, regions: list[tuple[int, int]]) -> None:
        """Regions of a call that did not end normally: never reused. Past half the area, the next
        transfer starts a fresh segment."""
        for _, length in regions:
            segment.regions.retire(length)
        if segment is self.segment and segment.regions.retired_bytes * 2 > segment.regions.size:
            self.segment = None
            segment.close()  # the store's mapping and calls in flight keep the pages until they end

    def lost(self, reason: str) -> None:
        """The store no longer maps the segment: inline from now on."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        self._turn_off(reason)

    def _turn_off(self, reason: str) -> None:
        self._off = True
        log.info("KV blocks to and from %s go inside messages: %s", self.target, reason)

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
