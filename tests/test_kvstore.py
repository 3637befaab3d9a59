"""KV store: the in-memory store's eviction/lease rules, and the gRPC service through its client."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import KVStoreClient, PutResult
from kvstore.server import serve
from kvstore.service import SERVICE_NAME, add_to_server
from kvstore.store import MemoryBlockStore, PutOutcome, StoreFullError
from pdserve.grpc_server import grpc_channel, start_server, stop_server
from pdserve.kvwire import decode_block, encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _h(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _store(capacity: int = 300, ttl: float = 10.0) -> tuple[MemoryBlockStore, FakeClock]:
    clock = FakeClock()
    return MemoryBlockStore(capacity, lease_ttl_s=ttl, clock=clock), clock


def _held(store: MemoryBlockStore, *names: str) -> list[bool]:
    return store.presence([_h(n) for n in names])


BLOCK = b"x" * 100  # store tests: capacity 300 holds exactly three of these

# ---- store unit tests ------------------------------------------------------------------------


def test_lru_eviction_order() -> None:
    store, _ = _store()
    for name in "abc":
        assert store.put(_h(name), BLOCK) is PutOutcome.STORED
    store.get([_h("a")])  # a becomes most recent: b is now the oldest
    store.lookup([_h("b")])  # lookup is not a use
    store.put(_h("d"), BLOCK)
    assert _held(store, "a", "b", "c", "d") == [True, False, True, True]
    store.put(_h("e"), BLOCK)
    assert _held(store, "a", "c", "d", "e") == [True, False, True, True]
    store.put(_h("a"), BLOCK)  # re-putting is a use too: d is now the oldest
    store.put(_h("f"), BLOCK)
    assert _held(store, "a", "d", "e", "f") == [True, False, True, True]
    stats = store.stats()
    assert (stats.evictions, stats.num_blocks, stats.used_bytes) == (3, 3, 300)
    store.check_consistency()


def test_put_existing_is_noop() -> None:
    store, _ = _store()
    assert store.put(_h("a"), BLOCK) is PutOutcome.STORED
    assert store.put(_h("a"), b"other data is ignored") is PutOutcome.ALREADY_PRESENT
    assert store.get([_h("a")]) == [BLOCK]
    assert (store.stats().puts, store.stats().used_bytes) == (1, 100)
    store.check_consistency()


def test_pinned_blocks_are_never_evicted() -> None:
    store, _ = _store()
    store.put(_h("a"), BLOCK, lease="r1")
    store.put(_h("b"), BLOCK)
    store.put(_h("c"), BLOCK)
    store.put(_h("d"), BLOCK)  # a is the oldest but pinned: b goes
    assert _held(store, "a", "b", "c", "d") == [True, False, True, True]
    assert store.stats().num_pinned == 1
    store.check_consistency()


def test_full_of_pinned_blocks_rejects_put_without_evicting() -> None:
    store, _ = _store()
    store.put(_h("a"), BLOCK, lease="r1")
    store.put(_h("b"), BLOCK, lease="r2")
    store.put(_h("c"), BLOCK)
    with pytest.raises(StoreFullError, match="200 of 300 bytes are pinned"):
        store.put(_h("d"), b"y" * 150)  # would need evicting a pinned block
    assert _held(store, "a", "b", "c", "d") == [True, True, True, False]  # c survived the attempt
    with pytest.raises(StoreFullError):
        MemoryBlockStore(50).put(_h("big"), BLOCK)  # larger than the whole store
    store.check_consistency()


def test_release_unpins_and_makes_evictable() -> None:
    store, _ = _store()
    store.put(_h("a"), BLOCK, lease="r1")
    store.put(_h("b"), BLOCK, lease="r1")
    store.get([_h("a"), _h("b"), _h("zz")], lease="r1")  # same lease: no second pin
    assert store.stats().num_pinned == 2
    assert store.release("r1") == 2
    assert store.release("r1") == 0  # already gone
    stats = store.stats()
    assert (stats.num_pinned, stats.num_leases, stats.num_blocks) == (0, 0, 2)
    store.put(_h("c"), BLOCK)
    store.put(_h("d"), BLOCK)
    assert _held(store, "a", "b") == [False, True]  # unpinned in order a, b: a was older
    store.check_consistency()


def test_release_drop_deletes_only_unshared_blocks() -> None:
    store, _ = _store(capacity=1000)
    for name in "abcd":
        store.put(_h(name), BLOCK, lease="r1")
    store.get([_h("a")], lease="r1")  # the owner reading its own block keeps it unshared
    store.get([_h("b")], lease="r2")  # pinned by another lease
    store.get([_h("c")])  # read anonymously: shared, someone may rely on it
    store.put(_h("e"), BLOCK, lease="r2")  # not r1's
    assert store.release("r1", drop=True) == 4
    assert _held(store, "a", "b", "c", "d", "e") == [False, True, True, False, True]
    store.check_consistency()
    assert store.release("r2", drop=True) == 2  # b was r1's, e is dropped: only r2 used it
    assert _held(store, "b", "c", "e") == [True, True, False]
    assert store.stats().num_pinned == 0
    store.check_consistency()


def test_lease_expires_after_ttl_since_last_use() -> None:
    store, clock = _store(ttl=10.0)
    store.put(_h("a"), BLOCK, lease="r1")
    clock.now = 9.0
    store.get([_h("nothing")], lease="r1")  # any use refreshes: now expires at 19
    clock.now = 15.0
    assert (store.stats().num_leases, store.stats().num_pinned) == (1, 1)
    clock.now = 19.0
    assert (store.stats().num_leases, store.stats().num_pinned) == (0, 0)
    assert store.release("r1") == 0
    assert _held(store, "a") == [True]  # expiry unpins, never deletes
    store.check_consistency()


def test_expiry_order_follows_refreshes() -> None:
    store, clock = _store(capacity=1000, ttl=10.0)
    store.put(_h("a"), BLOCK, lease="r1")
    clock.now = 1.0
    store.put(_h("b"), BLOCK, lease="r2")
    clock.now = 2.0
    store.put(_h("c"), BLOCK, lease="r1")  # r1 now expires after r2
    clock.now = 11.5
    assert store.stats().num_leases == 1
    assert store.release("r1") == 2
    store.check_consistency()


def test_a_release_is_final_for_the_ttl_even_before_the_lease_pinned_anything() -> None:
    # The race it closes: the gateway releases a cancelled request's lease, and a prefill
    # worker's put under that lease arrives after the release (the worker answered before the
    # cancel reached it, so it never releases it itself).
    store, clock = _store(capacity=1000, ttl=10.0)
    store.put(_h("a"), BLOCK, lease="r1")
    assert store.release("r1") == 1
    assert store.release("early") == 0  # released before anything was pinned under it
    clock.now = 5.0
    assert store.put(_h("b"), BLOCK, lease="early") is PutOutcome.STORED
    assert store.get([_h("a"), _h("b")], lease="r1") == [BLOCK, BLOCK]  # the data, no pin
    stats = store.stats()
    assert (stats.num_leases, stats.num_pinned, stats.num_blocks) == (0, 0, 2)
    assert store.release("early", drop=True) == 0 and _held(store, "b") == [True]  # not its block now
    store.check_consistency()
    clock.now = 15.1  # the ids are forgotten a TTL after their release: they pin again
    store.get([_h("a")], lease="r1")
    assert (store.stats().num_leases, store.stats().num_pinned) == (1, 1)
    store.check_consistency()


def test_lookup_counts_leading_present_hashes() -> None:
    store, _ = _store()
    store.put(_h("a"), BLOCK)
    store.put(_h("b"), BLOCK)
    assert store.lookup([_h("a"), _h("b"), _h("x"), _h("a")]) == 2
    assert store.lookup([_h("x"), _h("a")]) == 0
    assert store.lookup([]) == 0


def test_counters_and_bad_input() -> None:
    store, _ = _store()
    store.put(_h("a"), BLOCK)
    assert store.get([_h("a"), _h("x"), _h("a")]) == [BLOCK, None, BLOCK]
    stats = store.stats()
    assert (stats.gets, stats.hits, stats.misses, stats.bytes_in, stats.bytes_out) == (3, 2, 1, 100, 200)
    with pytest.raises(ValueError, match="empty"):
        store.put(b"", BLOCK)
    with pytest.raises(ValueError, match="empty"):
        store.get([b""])
    with pytest.raises(ValueError):
        MemoryBlockStore(0)


# ---- service tests over a real server -----------------------------------------------------

SPEC = KVFormat(fingerprint="ab" * 16, dtype=torch.float16, num_layers=4, num_kv_heads=2, head_dim=40,
                 block_size=16)  # payload 4*2*16*2*40*2 bytes = 20 KiB


def _wire_blocks(n: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(n):
        data = encode_block(torch.randn(SPEC.shape, generator=gen).to(SPEC.dtype), SPEC, SPEC.block_size)
        blocks.append((hashlib.sha256(data).digest(), data))
    return blocks


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout=15))


@asynccontextmanager
async def kvstore(capacity: int = 64 << 20) -> AsyncIterator[tuple[KVStoreClient, MemoryBlockStore, int]]:
    """A real server on a free loopback port, its store (for leak checks) and a client."""
    store = MemoryBlockStore(capacity)
    server, port = await start_server("127.0.0.1:0", lambda s: add_to_server(store, s), [SERVICE_NAME])
    client = KVStoreClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        yield client, store, port
    finally:
        await client.close()
        await stop_server(server, grace_s=0.5)
    store.check_consistency()


def test_put_get_round_trip_100_blocks() -> None:
    blocks = _wire_blocks(100)
    assert len(blocks[0][1]) > 20 << 10

    async def body() -> None:
        async with kvstore() as (client, store, _):
            assert await client.put_blocks("req-1", blocks) == PutResult(100, 0, 0)
            assert await client.put_blocks("req-2", blocks[:10]) == PutResult(0, 10, 0)
            got = await client.get_blocks([h for h, _ in blocks], request_id="req-3")
            assert got == [data for _, data in blocks]
            tensor, num_tokens = decode_block(got[7], SPEC)
            assert num_tokens == 16 and tensor.shape == SPEC.shape
            stats = await client.stats()
            assert (stats.num_blocks, stats.puts, stats.hits, stats.num_leases) == (100, 100, 100, 3)
            assert stats.used_bytes == stats.bytes_out == sum(len(d) for _, d in blocks)
    run(body)


def test_missing_blocks_flagged_in_order() -> None:
    (h0, d0), (h1, d1) = _wire_blocks(2)
    absent = _h("absent")

    async def body() -> None:
        async with kvstore() as (client, _, port):
            await client.put_blocks("", [(h0, d0), (h1, d1)])
            assert await client.get_blocks([h1, absent, h0]) == [d1, None, d0]
            async with grpc_channel(f"127.0.0.1:{port}") as channel:
                stub = kvstore_pb2_grpc.KVStoreStub(channel)
                replies = [m async for m in stub.GetBlocks(kvstore_pb2.GetBlocksRequest(block_hashes=[absent, h0]))]
            assert [(m.block_hash, m.missing, len(m.data)) for m in replies] == [(absent, True, 0), (h0, False, len(d0))]
    run(body)


def test_lookup_prefix() -> None:
    blocks = _wire_blocks(3)
    hashes = [h for h, _ in blocks]

    async def body() -> None:
        async with kvstore() as (client, _, _port):
            await client.put_blocks("", [blocks[0], blocks[1]])
            assert await client.lookup(hashes) == 2
            assert await client.lookup([_h("x"), *hashes]) == 0
            assert await client.presence([hashes[2], hashes[0]]) == [False, True]
    run(body)


def test_release_and_drop_leave_no_pins() -> None:
    blocks = _wire_blocks(4)

    async def body() -> None:
        async with kvstore() as (client, store, _):
            await client.put_blocks("prefill-1", blocks)
            await client.get_blocks([blocks[0][0]], request_id="decode-1")
            stats = await client.stats()
            assert (stats.num_pinned, stats.num_leases) == (4, 2)
            assert await client.release("prefill-1", drop=True) == 4  # cancel: 3 unshared blocks go
            assert await client.release("decode-1") == 1
            assert await client.release("never-existed") == 0
            await client.put_blocks("never-existed", blocks[1:2])  # a put that lost the race to its release
            stats = await client.stats()
            assert (stats.num_pinned, stats.num_leases, stats.num_blocks) == (0, 0, 2)
            store.check_consistency()
    run(body)


def test_garbage_data_rejected() -> None:
    (h0, d0), (h1, d1) = _wire_blocks(2)
    bad_version = bytearray(d1)
    bad_version[4] = 9

    async def body() -> None:
        async with kvstore() as (client, store, _):
            result = await client.put_blocks("r", [
                (_h("g"), b"not a kv block at all, definitely not"),
                (_h("t"), d0[:-1]),  # truncated
                (_h("v"), bytes(bad_version)),
                (b"", d0),  # no hash
                (h0, d0),
            ])
            assert result == PutResult(stored=1, already_present=0, rejected=4)
            assert store.stats().num_blocks == 1
    run(body)


def test_full_store_rejects_over_grpc() -> None:
    blocks = _wire_blocks(3)

    async def body() -> None:
        async with kvstore(capacity=2 * len(blocks[0][1])) as (client, _, _port):
            assert await client.put_blocks("r", blocks) == PutResult(stored=2, already_present=0, rejected=1)
            await client.release("r")
            assert await client.put_blocks("r", blocks[2:]) == PutResult(1, 0, 0)
            assert (await client.stats()).evictions == 1
    run(body)


def test_bad_requests_get_status_codes_without_tracebacks() -> None:
    async def body() -> None:
        async with kvstore() as (client, store, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.release("")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "request_id is required"
            with pytest.raises(grpc.aio.AioRpcError) as err:  # server-streaming handler
                await client.get_blocks([b""])
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "block hash is empty")
            store.stats = lambda: 1 / 0  # an unexpected bug inside the handler
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stats()
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "ZeroDivisionError" in err.value.details() and "Traceback" not in err.value.details()
            del store.stats
    run(body)


def test_health_and_reflection() -> None:
    async def body() -> None:
        server, port = await serve("127.0.0.1:0", capacity_bytes=1 << 20, lease_ttl_s=5.0)
        try:
            async with grpc_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health.Check(health_pb2.HealthCheckRequest(service="no.Such"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert SERVICE_NAME in await _reflected_services(channel)
        finally:
            await stop_server(server, grace_s=0.5)
    run(body)


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for reply in stub.ServerReflectionInfo(ask()):
        names |= {s.name for s in reply.list_services_response.service}
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    return names


def test_server_main_stops_gracefully_on_sigterm() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.server", "--bind", "127.0.0.1:0", "--capacity-mb", "1"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = _wait_for_port(proc)

        async def check() -> None:
            async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=5) as client:
                assert (await client.stats()).capacity_bytes == 1 << 20
        run(check)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def _wait_for_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stderr is not None
    for line in proc.stderr:  # the server logs its bound port once it serves
        match = re.search(r"kvstore listening on port (\d+)", line)
        if match:
            return int(match.group(1))
    raise AssertionError(f"server exited ({proc.wait()}) without reporting its port")
