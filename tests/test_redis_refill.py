"""A restarted Redis comes back empty (no persistence, as after a crash): the kvstore writes the
blocks its memory tier holds into it again, so that a later kvstore restart still finds every one
(kvstore.tiered, "Refill"). Real redis-server, real kvstore gRPC server on loopback; every wait is a
condition with a deadline."""

from __future__ import annotations

import asyncio
import hashlib
import time

import redis
import torch

from kvstore.redis_tier import block_key
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from redis_fixture import RedisServer, redis_server  # noqa: F401 - pytest fixture
from test_kvstore_tiers import _start as start_tiered_store
from test_kvstore_tiers import _stop

SPEC = KVFormat("0" * 32, torch.float32, 2, 1, 4, 4)
DEADLINE_S = 60.0  # generous: the refill is bounded by the store's poll (2 s) and its rate, not by this


def _h(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def _block(i: int) -> bytes:
    return encode_block(torch.full(SPEC.shape, float(i)), SPEC, SPEC.block_size)


async def _start(url: str):
    return await start_tiered_store(url, capacity_blocks=4096, block_bytes=len(_block(0)))


def _in_redis(server: RedisServer, hashes: list[bytes]) -> int:
    try:
        return redis.Redis(port=server.port).exists(*[block_key(h) for h in hashes])
    except redis.RedisError:
        return 0


async def _await_in_redis(server: RedisServer, hashes: list[bytes]) -> int:
    """Blocks of `hashes` in Redis, once all are there or at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while (found := _in_redis(server, hashes)) < len(hashes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return found


async def _refilled_when_done(store) -> int:
    """The store's refill count once no refill runs (at the deadline otherwise). A refill that
    restarts (Redis noticed twice) may have written a batch it never counted: never more, though,
    than the blocks Redis lacked."""
    deadline = time.monotonic() + DEADLINE_S
    while store.refilling and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return store.refilled


async def _restart_finds_all(url: str, hashes: list[bytes], blocks: list[bytes]) -> None:
    """A fresh kvstore (empty memory tier) on the same Redis finds every block there."""
    server, store, client = await _start(url)
    assert (await client.stats()).num_blocks == 0
    assert await client.lookup(hashes) == len(hashes)
    assert await client.get_blocks(hashes) == blocks
    await _stop(server, store, client)


def test_redis_restarted_unnoticed_is_refilled(redis_server: RedisServer) -> None:  # noqa: F811
    """Redis restarts between two of the store's polls, with no traffic to notice it: the poll sees
    a new run_id and the refill writes the blocks again."""
    hashes = [_h(f"quiet{i}") for i in range(300)]
    blocks = [_block(i) for i in range(len(hashes))]

    async def scenario() -> None:
        server, store, client = await _start(redis_server.url)
        await client.put_blocks("", list(zip(hashes, blocks)))
        assert await store.flush()
        assert _in_redis(redis_server, hashes) == len(hashes)
        redis_server.restart()  # empty again, same port
        assert _in_redis(redis_server, hashes) == 0
        assert await _await_in_redis(redis_server, hashes) == len(hashes)
        assert 0 < await _refilled_when_done(store) <= len(hashes)
        await _stop(server, store, client)
        await _restart_finds_all(redis_server.url, hashes, blocks)

    asyncio.run(scenario())


def test_redis_back_after_an_outage_gets_old_and_new_blocks(redis_server: RedisServer) -> None:  # noqa: F811
    """Blocks put before a Redis outage (lost with it) and during it (their write-through failed)
    are all in the new Redis once it is back; blocks it already holds are not written again."""
    before = [_h(f"before{i}") for i in range(200)]
    during = [_h(f"during{i}") for i in range(50)]
    hashes = before + during
    blocks = [_block(i) for i in range(len(hashes))]

    async def scenario() -> None:
        server, store, client = await _start(redis_server.url)
        await client.put_blocks("", list(zip(before, blocks)))
        assert await store.flush()
        redis_server.kill()
        await client.put_blocks("", list(zip(during, blocks[len(before):])))
        assert await store.flush()
        redis_server.start()  # empty: it had no persistence
        redis.Redis(port=redis_server.port).set(block_key(before[0]), blocks[0])  # already there
        assert await _await_in_redis(redis_server, hashes) == len(hashes)
        assert (await client.stats()).backend_up
        assert 0 < await _refilled_when_done(store) <= len(hashes) - 1  # not the block Redis had
        await _stop(server, store, client)
        await _restart_finds_all(redis_server.url, hashes, blocks)

    asyncio.run(scenario())


def test_refill_keeps_to_its_rate(redis_server: RedisServer) -> None:  # noqa: F811
    """At refill_bytes_per_s, N bytes take at least N / rate seconds (a lower bound: true on any machine)."""
    hashes = [_h(f"rate{i}") for i in range(128)]
    blocks = [_block(i) for i in range(len(hashes))]
    total = sum(len(b) for b in blocks)

    async def scenario() -> None:
        server, store, client = await _start(redis_server.url)
        store.refill_bytes_per_s = total / 0.5  # the whole refill: at least 0.5 s
        await client.put_blocks("", list(zip(hashes, blocks)))
        assert await store.flush()
        redis_server.restart()
        deadline = time.monotonic() + DEADLINE_S
        while not store.refilling and store.refilled == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        assert await _await_in_redis(redis_server, hashes) == len(hashes)
        while store.refilling and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert time.monotonic() - started >= 0.5 * (1 - REFILL_SHARE_BEFORE_START)
        await _stop(server, store, client)

    asyncio.run(scenario())


# The refill may have written its first batch (64 of 128 blocks) before the test saw it start.
REFILL_SHARE_BEFORE_START = 0.5
