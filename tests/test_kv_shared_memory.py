"""KV blocks through a staging segment of shared memory (kvstore.shared_memory) against a real store.

The reference is the same store's answers through gRPC messages alone (a client without a segment):
every byte a put stores and a get returns must be the same either way, including where the staging
area is too small, where the store cannot see the segment (another host: another directory here),
and after a call broken off mid-stream.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from kvstore.client import KVStoreClient, PutResult, segment_message
from kvstore.service import SERVICE_NAME, KVStoreServicer
from kvstore.shared_memory import AREA_OFFSET, AttachedSegments, RegionAllocator, StagingSegment
from kvstore.store import MemoryBlockStore
from pdserve.grpc_server import start_server, stop_server
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.test_kvstore import _wire_blocks, run

BLOCKS = _wire_blocks(24)
BLOCK_BYTES = len(BLOCKS[0][1])


@asynccontextmanager
async def store_and_clients(client_dir: Path, store_dir: Path, area_bytes: int = 1 << 20
                            ) -> AsyncIterator[tuple[KVStoreClient, KVStoreClient, KVStoreServicer]]:
    """A real store on loopback mapping segments from `store_dir`; a client staging in `client_dir`,
    a client sending everything inside messages (the reference), and the store's servicer."""
    store = MemoryBlockStore(64 << 20)
    servicer = KVStoreServicer(store, segments=AttachedSegments(store_dir))

    def add(server: grpc.aio.Server) -> None:
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, server)

    server, port = await start_server("127.0.0.1:0", add, [SERVICE_NAME])
    staged = KVStoreClient(f"127.0.0.1:{port}", timeout_s=10, shared_memory_bytes=area_bytes,
                           shared_memory_dir=client_dir)
    inline = KVStoreClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield staged, inline, servicer
    finally:
        await staged.close()
        await inline.close()
        await stop_server(server, grace_s=0.5)
        servicer.segments.close()
    store.check_consistency()


def test_blocks_through_the_segment_are_the_bytes_sent_inline(tmp_path: Path) -> None:
    hashes = [h for h, _ in BLOCKS]

    async def body() -> None:
        async with store_and_clients(tmp_path, tmp_path) as (staged, inline, _):
            assert await staged.put_blocks("a", BLOCKS[:16]) == PutResult(16, 0, 0)
            assert staged.shared_memory
            assert await inline.put_blocks("b", BLOCKS) == PutResult(8, 16, 0)
            assert await staged.get_blocks(hashes) == await inline.get_blocks(hashes) == [d for _, d in BLOCKS]
            assert staged.blocks_in_shared_memory == 16 + 24
            assert staged._staging.segment.regions.largest_free() == 1 << 20  # every region given back
    run(body)


def test_a_get_larger_than_the_area_sends_the_rest_inline(tmp_path: Path) -> None:
    area = 5 * BLOCK_BYTES + BLOCK_BYTES // 2  # room for 5 blocks of the 24

    async def body() -> None:
        async with store_and_clients(tmp_path, tmp_path, area) as (staged, inline, _):
            await inline.put_blocks("", BLOCKS)
            await staged.put_blocks("", BLOCKS[:2])  # learns the block size
            assert staged.shared_memory
            got = await staged.get_blocks([h for h, _ in BLOCKS] + [b"\0" * 32])
            assert got == [d for _, d in BLOCKS] + [None]
            assert staged.blocks_in_shared_memory == 2 + 5
    run(body)


def test_a_store_that_cannot_see_the_segment_gets_the_bytes_inline(tmp_path: Path) -> None:
    client_dir, store_dir = tmp_path / "here", tmp_path / "elsewhere"
    client_dir.mkdir()
    store_dir.mkdir()

    async def body() -> None:
        async with store_and_clients(client_dir, store_dir) as (staged, inline, _):
            assert await staged.put_blocks("", BLOCKS[:4]) == PutResult(4, 0, 0)
            assert not staged.shared_memory
            assert await inline.get_blocks([h for h, _ in BLOCKS[:4]]) == [d for _, d in BLOCKS[:4]]
            assert await staged.get_blocks([h for h, _ in BLOCKS[:4]]) == [d for _, d in BLOCKS[:4]]
            assert staged.blocks_in_shared_memory == 0
        assert list(client_dir.iterdir()) == []  # the unused segment was removed
    run(body)


def test_a_store_that_loses_the_segment_gets_the_put_again_inline(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    async def body() -> None:
        async with store_and_clients(tmp_path, tmp_path) as (staged, inline, servicer):
            await staged.put_blocks("", BLOCKS[:2])
            assert staged.blocks_in_shared_memory == 2
            servicer.segments.close()
            servicer.segments.directory = elsewhere  # as a store restarted on another host
            assert await staged.put_blocks("", BLOCKS[2:6]) == PutResult(4, 0, 0)
            assert not staged.shared_memory
            assert await inline.get_blocks([h for h, _ in BLOCKS[:6]]) == [d for _, d in BLOCKS[:6]]
    run(body)


def test_a_caller_without_the_token_cannot_use_a_segment(tmp_path: Path) -> None:
    async def body() -> None:
        async with store_and_clients(tmp_path, tmp_path) as (staged, inline, servicer):
            await staged.put_blocks("", BLOCKS[:1])
            segment = staged._staging.segment
            stub = kvstore_pb2_grpc.KVStoreStub(inline._channel)
            for name, token in ((segment.name, b"x" * 16), ("../../etc/passwd", segment.token)):
                answer = await stub.AttachSegment(kvstore_pb2.SharedSegment(name=name, token=token))
                assert not answer.attached and answer.reason
            forged = kvstore_pb2.SharedSegment(name=segment.name, token=b"x" * 16)
            requests = [kvstore_pb2.PutBlockRequest(block_hash=b"h" * 32, segment=forged, offset=0, length=100)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PutBlocks(iter(requests))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "wrong token" in err.value.details()
            outside = kvstore_pb2.GetBlocksRequest(block_hashes=[BLOCKS[0][0]], segment=segment_message(segment),
                                                   offset=segment.regions.size, capacity=BLOCK_BYTES)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.GetBlocks(outside):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "outside" in err.value.details()
            assert servicer.store.memory.stats().num_blocks == 1
    run(body)


def test_a_get_broken_off_retires_its_region_and_a_fresh_segment_follows(tmp_path: Path) -> None:
    area = 4 * BLOCK_BYTES

    async def body() -> None:
        async with store_and_clients(tmp_path, tmp_path, area) as (staged, inline, _):
            await inline.put_blocks("", BLOCKS[:4])
            await staged.put_blocks("", BLOCKS[:1])
            first = staged._staging.segment
            stream = staged.stream_blocks([h for h, _ in BLOCKS[:3]])
            assert (await anext(stream))[1] == BLOCKS[0][1]
            await stream.aclose()  # the store may still write the rest: the region is not reused
            assert first.regions.retired_bytes == 3 * BLOCK_BYTES
            assert staged._staging.segment is None and not first.path.exists()
            assert await staged.get_blocks([h for h, _ in BLOCKS[:4]]) == [d for _, d in BLOCKS[:4]]
            assert staged.shared_memory and staged._staging.segment is not first
    run(body)


def test_segments_of_dead_processes_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    code = ("import os, sys; from pathlib import Path; from kvstore.shared_memory import StagingSegment; "
            "s = StagingSegment(4096, Path(sys.argv[1])); print(s.name, flush=True); os._exit(0)")
    dead = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert (tmp_path / dead).exists()
    live = StagingSegment(4096, tmp_path)
    later = StagingSegment(4096, tmp_path)  # its creation finds `live` locked: kept
    try:
        assert not (tmp_path / dead).exists() and live.path.exists() and later.path.exists()
        assert os.stat(live.path).st_mode & 0o777 == 0o600 and os.path.getsize(live.path) == AREA_OFFSET + 4096
    finally:
        live.close()
        later.close()
    assert list(tmp_path.iterdir()) == []


def test_region_allocator_first_fit_and_merging() -> None:
    regions = RegionAllocator(100)
    a, b, c = regions.reserve(30), regions.reserve(30), regions.reserve(30)
    assert (a, b, c, regions.reserve(11), regions.largest_free()) == (0, 30, 60, None, 10)
    regions.free(b, 30)
    assert regions.reserve(31) is None and regions.largest_free() == 30
    regions.free(a, 30)  # merges with b's range
    assert regions.largest_free() == 60
    regions.free(c, 30)  # merges both sides into one range again
    assert regions._free == [(0, 100)] and regions.reserve(100) == 0


def test_the_store_unmaps_segments_whose_file_is_gone(tmp_path: Path) -> None:
    segments = AttachedSegments(tmp_path)
    first, second = StagingSegment(4096, tmp_path), StagingSegment(4096, tmp_path)
    try:
        segments.attach(first.name, first.token)
        first.close()  # its worker closed (or died and a later one removed the file)
        segments.attach(second.name, second.token)
        assert list(segments._maps) == [second.name]
    finally:
        second.close()
        segments.close()
