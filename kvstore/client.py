"""Async client of the KV store, used by the prefill and decode workers and the gateway.

Protobuf stays inside this module: callers pass and receive plain bytes, ints and dataclasses.
Failed calls raise grpc.aio.AioRpcError (e.g. UNAVAILABLE when the store is down).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, fields
from types import TracebackType

from kvstore.store import StoreStats
from pdserve.grpc_server import grpc_channel
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


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

    def __init__(self, target: str, timeout_s: float | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s  # deadline of each call; None = no deadline
        self._channel = grpc_channel(target)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def put_blocks(self, request_id: str, blocks: Iterable[tuple[bytes, bytes]]) -> PutResult:
        """Upload (hash, wire data) pairs in one stream, pinned under `request_id` ("" = unpinned)."""
        async def requests() -> AsyncIterator[kvstore_pb2.PutBlockRequest]:
            for block_hash, data in blocks:
                yield kvstore_pb2.PutBlockRequest(request_id=request_id, block_hash=block_hash, data=data)

        response = await self._stub.PutBlocks(requests(), timeout=self.timeout_s)
        return PutResult(response.stored, response.already_present, response.rejected)

    async def stream_blocks(self, hashes: Sequence[bytes], request_id: str = ""
                            ) -> AsyncIterator[tuple[bytes, bytes | None]]:
        """Yield (hash, data or None if missing) in request order as blocks arrive.

        A non-empty `request_id` pins the returned blocks under that lease.
        """
        call = self._stub.GetBlocks(
            kvstore_pb2.GetBlocksRequest(request_id=request_id, block_hashes=hashes),
            timeout=self.timeout_s)
        count = 0
        try:
            async for block in call:
                if count >= len(hashes) or block.block_hash != hashes[count]:
                    raise KVStoreProtocolError(f"GetBlocks answer {count} is not for the hash asked for")
                yield block.block_hash, (None if block.missing else block.data)
                count += 1
        finally:
            call.cancel()  # no-op when finished; stops the transfer if the caller broke off early
        if count != len(hashes):
            raise KVStoreProtocolError(f"GetBlocks returned {count} of {len(hashes)} blocks")

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

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
