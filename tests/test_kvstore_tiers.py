"""KV store tiers: watermark eviction in memory, the Redis tier (write-through, promotion, restart
recovery) against a real redis-server, Redis outages, and the residency index."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import pytest
import redis

from kvstore.client import KVStoreClient
from kvstore.metrics import KVSTORE_BACKEND_ERRORS, KVSTORE_EVICTIONS
from kvstore.redis_tier import block_key
from kvstore.residency import ResidencyIndex
from kvstore.config import KVStoreConfig
from kvstore.server import parse_backend, serve_store
from kvstore.store import MemoryBlockStore, StoreFullError
from pdserve.grpc_server import stop_server
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from redis_fixture import RedisServer, redis_server  # noqa: F401 - pytest fixture

import torch


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _h(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


# ---- memory tier: watermarks -----------------------------------------------------------------


def _watermarked(evicted: list[str], names: dict[bytes, str], clock: FakeClock | None = None) -> MemoryBlockStore:
    return MemoryBlockStore(1000, lease_ttl_s=10, clock=clock or FakeClock(), high_watermark=0.8,
                            low_watermark=0.5, on_evict=lambda h, _: evicted.append(names[h]))


def test_watermarks_evict_lru_down_to_low_in_order() -> None:
    evicted: list[str] = []
    names = {_h(c): c for c in "ABCDEFGHIJ"}
    store = _watermarked(evicted, names)
    for c in "ABCDEFGH":  # 800 bytes: at the high watermark, nothing evicted yet
        store.put(_h(c), b"x" * 100)
    assert evicted == []
    store.get([_h("A")])  # A becomes most recently used
    store.put(_h("I"), b"x" * 100)  # would be 900 > 800: sweep until used + 100 <= 500
    assert evicted == ["B", "C", "D", "E"]
    assert store.stats().used_bytes == 500
    store.put(_h("J"), b"x" * 100)  # 600 <= 800: no eviction
    assert evicted == ["B", "C", "D", "E"]
    store.check_consistency()


def test_pinned_blocks_survive_watermark_pressure() -> None:
    evicted: list[str] = []
    names = {_h(f"{i}"): f"{i}" for i in range(20)}
    store = _watermarked(evicted, names)
    for i in range(6):
        store.put(_h(f"{i}"), b"x" * 100, lease="r1")  # pinned
    for i in range(6, 20):
        store.put(_h(f"{i}"), b"x" * 100)
    assert all(store.presence([_h(f"{i}") for i in range(6)]))
    assert not any(name in evicted for name in "012345")
    with pytest.raises(StoreFullError):  # 10 pinned blocks would be 1000: a pinned put over capacity
        for i in range(6, 11):
            store.put(_h(f"p{i}"), b"y" * 100, lease="r2")
    store.check_consistency()


def test_expired_leases_free_their_blocks_for_eviction() -> None:
    evicted: list[str] = []
    clock = FakeClock()
    names = {_h(f"{i}"): f"{i}" for i in range(20)}
    store = _watermarked(evicted, names, clock)
    for i in range(8):
        store.put(_h(f"{i}"), b"x" * 100, lease="gone")
    assert store.stats().num_pinned == 8
    clock.now = 11.0  # the lease's owner vanished: its pins expire after the TTL
    store.put(_h("8"), b"x" * 100)
    assert store.stats().num_leases == 0
    assert evicted == ["0", "1", "2", "3"]
    store.check_consistency()


def test_bad_backend_and_watermarks_are_refused() -> None:
    with pytest.raises(ValueError, match="kv-backend"):
        parse_backend("memcached://x")
    with pytest.raises(ValueError, match="low_watermark"):
        MemoryBlockStore(100, high_watermark=0.5, low_watermark=0.9)


# ---- residency -------------------------------------------------------------------------------


def test_residency_index_prefixes_resets_and_expiry() -> None:
    clock = FakeClock()
    index = ResidencyIndex(ttl_s=5, clock=clock)
    a, b, c = _h("a"), _h("b"), _h("c")
    assert index.report("w1", [a], [], reset=False) is True  # unknown worker: asks for a full report
    assert index.report("w1", [a, b], [], reset=True) is False
    assert index.report("w2", [a, b, c], [], reset=True) is False
    assert index.prefixes([a, b, c]) == [("w2", 3), ("w1", 2)]
    clock.now = 4.0
    index.report("w2", [], [a], reset=False)  # evicted a: holds nothing leading
    assert index.prefixes([a, b, c]) == [("w1", 2)]
    clock.now = 6.0
    assert index.prefixes([a, b]) == []  # w1 went silent; w2 holds b, c but not a
    assert index.workers() == ["w2"]


# ---- the Redis tier, through the gRPC service --------------------------------------------------

SPEC = KVFormat("0" * 32, torch.float32, 2, 1, 4, 4)


def _block(i: int) -> bytes:
    return encode_block(torch.full(SPEC.shape, float(i)), SPEC, SPEC.block_size)


BLOCK_BYTES = len(_block(0))


async def _start(url: str, capacity_blocks: int = 1000, block_bytes: int = BLOCK_BYTES):
    """A kvstore on a free port with a Redis tier at `url`, quick to notice an outage and retry."""
    # Exact-fit watermarks: the tests count blocks and evictions one put at a time.
    config = KVStoreConfig(bind="127.0.0.1:0", capacity_bytes=capacity_blocks * block_bytes, high_watermark=1.0,
                           low_watermark=1.0, backend=url, backend_timeout_s=0.3)
    server, port, store = await serve_store(config)
    store.redis.retry_interval_s = 0.2
    return server, store, KVStoreClient(f"127.0.0.1:{port}", timeout_s=5)


async def _stop(server, store, client) -> None:
    await client.close()
    await stop_server(server, 0)
    await store.close()


def test_write_through_and_restart_recovers_blocks_from_redis(redis_server: RedisServer) -> None:
    hashes = [_h(f"r{i}") for i in range(20)]

    async def scenario() -> None:
        server, store, client = await _start(redis_server.url)
        await client.put_blocks("", [(h, _block(i)) for i, h in enumerate(hashes)])
        assert await store.flush()
        await _stop(server, store, client)
        assert redis.Redis(port=redis_server.port).exists(*[block_key(h) for h in hashes]) == 20

        server, store, client = await _start(redis_server.url)  # a fresh, empty memory tier
        assert (await client.stats()).num_blocks == 0
        assert await client.lookup(hashes) == 20  # Lookup sees Redis-only blocks
        datas = await client.get_blocks(hashes, request_id="r")
        assert datas == [_block(i) for i in range(20)]
        stats = await client.stats()
        assert stats.num_blocks == 20 and stats.backend_hits == 20 and stats.num_pinned == 20
        await _stop(server, store, client)

    asyncio.run(scenario())


def test_memory_evictions_are_served_from_redis(redis_server: RedisServer) -> None:
    hashes = [_h(f"e{i}") for i in range(12)]

    async def scenario() -> None:
        evictions = KVSTORE_EVICTIONS.labels(tier="memory")._value.get()
        server, store, client = await _start(redis_server.url, capacity_blocks=4)
        for i, h in enumerate(hashes):
            await client.put_blocks("", [(h, _block(i))])
        assert await store.flush()
        assert (await client.stats()).num_blocks == 4
        assert KVSTORE_EVICTIONS.labels(tier="memory")._value.get() - evictions == 8
        assert await client.get_blocks(hashes[:3]) == [_block(i) for i in range(3)]
        await _stop(server, store, client)

    asyncio.run(scenario())


def test_redis_outage_serves_from_memory_then_recovers(redis_server: RedisServer, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.redis_tier")

    async def scenario() -> None:
        errors = KVSTORE_BACKEND_ERRORS._value.get()
        server, store, client = await _start(redis_server.url, capacity_blocks=64)
        redis_server.kill()

        async def one(i: int) -> None:
            h = _h(f"o{i}")
            result = await client.put_blocks(f"req{i}", [(h, _block(i))])
            assert result.stored == 1
            assert await client.lookup([h]) == 1
            assert await client.get_blocks([h, _h(f"never{i}")], request_id=f"req{i}") == [_block(i), None]
            await client.release(f"req{i}")
        await asyncio.gather(*(one(i) for i in range(40)))  # every request completes
        stats = await client.stats()
        assert not stats.backend_up and stats.backend_errors >= 1
        assert KVSTORE_BACKEND_ERRORS._value.get() - errors >= 1
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]

        redis_server.start()  # Redis is back (empty: it had no persistence)
        # Back once the back-off has passed and a call or the monitor's probe found it: a condition.
        deadline = time.monotonic() + 30
        while not (await client.stats()).backend_up:
            assert time.monotonic() < deadline, "the Redis tier did not come back"
            await client.lookup([_h("probe")])  # a call that asks Redis (a memory miss)
            await asyncio.sleep(0.02)
        await client.put_blocks("", [(_h("after"), _block(99))])
        assert await store.flush()
        assert redis.Redis(port=redis_server.port).exists(block_key(_h("after"))) == 1
        assert any("is back" in r.getMessage() for r in caplog.records)
        await _stop(server, store, client)

    asyncio.run(scenario())


def test_unreachable_redis_at_start_still_serves() -> None:
    async def scenario() -> None:
        dead = RedisServer()  # a free port nobody listens on
        server, store, client = await _start(dead.url)
        await client.put_blocks("", [(_h("x"), _block(1))])
        assert await client.get_blocks([_h("x")]) == [_block(1)]
        assert await client.lookup([_h("x"), _h("y")]) == 1
        await _stop(server, store, client)

    asyncio.run(scenario())


def test_big_reads_are_split_into_mgets_of_bounded_size(redis_server: RedisServer) -> None:
    """A long conversation's blocks come back in MGETs of about MGET_BYTES each, in one pipeline:
    one huge reply would outlast the socket timeout on a busy host (and read as an outage)."""
    from kvstore.redis_tier import MGET_BYTES, RedisTier

    big = b"k" * (3 << 20)  # 3 MiB: two per MGET
    hashes = [_h(f"big{i}") for i in range(5)]

    async def scenario() -> None:
        tier = RedisTier(redis_server.url, timeout_s=5)
        assert await tier.set_many([(h, big + bytes([i])) for i, h in enumerate(hashes)])
        r = redis.Redis(port=redis_server.port)
        before = r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
        got = await tier.get_many([*hashes, _h("absent")])
        assert got == [big + bytes([i]) for i in range(5)] + [None]
        calls = r.info("commandstats")["cmdstat_mget"]["calls"] - before
        assert calls == -(-6 // (MGET_BYTES // len(got[0]))) == 3
        await tier.close()

    asyncio.run(scenario())
