"""TieredStore: the memory tier (MemoryBlockStore) in front of an optional Redis tier.

Write-through, not spill-on-evict, is the policy: every newly stored block is queued for Redis as
soon as it is put, and a background writer sends the queue in pipelined batches. Why:
  * a kvstore that restarts (crash, deploy, OOM kill) finds every block that was ever written
    again, not only the ones that happened to be evicted before it went away;
  * eviction stays O(1) and synchronous: it never has to wait for Redis to accept the bytes;
  * a block's bytes are sent once, off the request path (the put answers before Redis sees it).
The price is Redis bandwidth for blocks that die young; Redis's own LRU (`maxmemory` +
`allkeys-lru`) drops those. Blocks whose write-through failed (Redis down, or the bounded queue
overflowed) are remembered and spilled when the memory tier evicts them, so they get a second
chance once Redis is back.

Refill: a Redis that comes back after an outage, or restarts between two polls, may be empty (see
kvstore.redis_tier). Without a refill the durable tier would stay empty for good: every block
was written through once, and nothing writes it again, so the next kvstore restart would find
nothing. So on `RedisTier.on_restart` a background task walks every block the memory tier holds,
asks Redis which it lacks (a pipeline of EXISTS per batch) and writes those, at most
`refill_bytes_per_s` so that the refill does not crowd out live traffic to Redis. A new restart
starts it over; a failure stops it (the next comeback starts it again).

Reads: a memory miss is looked up in Redis with one MGET and promoted into memory (pinned under
the caller's lease, like a memory hit). `presence` (Lookup) also asks Redis about memory misses,
so the gateway's prefix lookup sees blocks that only Redis holds.

Redis trouble never fails a call: RedisTier turns it into misses (see kvstore.redis_tier).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.metrics import KVSTORE_BLOCKS, KVSTORE_EVICTIONS
from kvstore.redis_tier import RedisTier
from kvstore.store import MemoryBlockStore, PutOutcome, StoreFullError, StoreStats

log = logging.getLogger(__name__)

WRITE_BATCH_BLOCKS = 64
WRITE_BATCH_BYTES = 8 << 20
REFILL_BATCH_BLOCKS = 64


class TieredStore:
    """Memory tier plus optional Redis tier; see the module docstring. Call `start()` in the loop."""

    def __init__(self, memory: MemoryBlockStore, redis: RedisTier | None = None, *,
                 max_pending_bytes: int = 256 << 20, poll_interval_s: float = 2.0,
                 refill_bytes_per_s: float = 64 << 20) -> None:
        self.memory = memory
        self.redis = redis
        self.max_pending_bytes = max_pending_bytes
        self.poll_interval_s = poll_interval_s
        self.refill_bytes_per_s = refill_bytes_per_s
        memory.on_evict = self._on_evict
        if redis is not None:
            redis.on_restart = self._start_refill
        self._refill_task: asyncio.Task | None = None
        self.refilled = 0  # blocks re-written into Redis after it came back
        self._pending: OrderedDict[bytes, bytes] = OrderedDict()  # write-through queue, oldest first
        self._pending_bytes = 0
        self._unpersisted: set[bytes] = set()  # in memory, but their Redis write failed
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.written = 0  # blocks Redis accepted
        self._writing = False  # a batch is on its way to Redis

    async def start(self) -> TieredStore:
        if self.redis is not None and not self._tasks:
            self._tasks = [asyncio.create_task(self._write_forever(), name="kv-redis-writer"),
                           asyncio.create_task(self._poll_forever(), name="kv-redis-monitor")]
            await self.redis.poll()  # one early probe: an unreachable Redis is logged at start
        return self

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._refill_task] if self._refill_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._refill_task = [], None
        if self.redis is not None:
            await self.redis.close()

    # ---- block operations ------------------------------------------------------------------

    def put(self, block_hash: bytes, data: bytes, lease: str = "") -> PutOutcome:
        """Store in memory (raises StoreFullError like MemoryBlockStore.put) and queue for Redis."""
        outcome = self.memory.put(block_hash, data, lease)
        if outcome is PutOutcome.STORED:
            self._queue_write(block_hash, bytes(data))
        self._update_gauge()
        return outcome

    async def get(self, hashes: Sequence[bytes], lease: str = "") -> list[bytes | None]:
        """Data of each hash (None if in neither tier); Redis hits are promoted into memory."""
        found = self.memory.get(hashes, lease)
        missing = [i for i, d in enumerate(found) if d is None]
        if missing:
            for i in missing:  # a block evicted while its write-through is still queued
                found[i] = self._pending.get(hashes[i])
            missing = [i for i in missing if found[i] is None]
        if missing and self.redis is not None:
            datas = await self.redis.get_many([hashes[i] for i in missing])
            for i, data in zip(missing, datas):
                if data is not None:
                    found[i] = data
                    self._promote(hashes[i], data, lease)
        self._update_gauge()
        return found

    async def presence(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is in some tier (a Redis outage reads as "not present")."""
        present = self.memory.presence(hashes)
        missing = [i for i, p in enumerate(present) if not p and hashes[i] not in self._pending]
        for i, p in enumerate(present):
            present[i] = p or hashes[i] in self._pending
        if missing and self.redis is not None:
            answers = await self.redis.exists_many([hashes[i] for i in missing])
            for i, there in zip(missing, answers):
                present[i] = there
        return present

    def release(self, lease: str, drop: bool = False) -> int:
        released = self.memory.release(lease, drop)
        self._update_gauge()
        return released

    def stats(self) -> StoreStats:
        base = self.memory.stats()
        if self.redis is None:
            return base
        return dataclasses.replace(base, backend_hits=self.redis.hits, backend_errors=self.redis.errors,
                                   backend_up=self.redis.up)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the write-through queue is empty (tests, shutdown); False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (self._pending or self._writing) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return not (self._pending or self._writing)

    # ---- internals -------------------------------------------------------------------------

    def _promote(self, block_hash: bytes, data: bytes, lease: str) -> None:
        try:
            self.memory.put(block_hash, data, lease)
        except StoreFullError:
            pass  # everything is pinned: serve the bytes without caching them
        self._unpersisted.discard(block_hash)

    def _queue_write(self, block_hash: bytes, data: bytes) -> None:
        if self.redis is None:
            return
        self._pending[block_hash] = data
        self._pending_bytes += len(data)
        while self._pending_bytes > self.max_pending_bytes:
            # Redis is slower than the puts: remember the oldest as unwritten (spilled on eviction).
            old, old_data = self._pending.popitem(last=False)
            self._pending_bytes -= len(old_data)
            self._unpersisted.add(old)
        self._wake.set()

    def _on_evict(self, block_hash: bytes, data: bytes) -> None:
        KVSTORE_EVICTIONS.labels(tier="memory").inc()
        if block_hash in self._unpersisted:
            self._unpersisted.discard(block_hash)
            if self.redis is not None and self.redis.up:
                self._queue_write(block_hash, data)  # spill: the last chance to keep it

    async def _write_forever(self) -> None:
        assert self.redis is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = self._take_batch()
                self._writing = True
                try:
                    ok = await self.redis.set_many(batch)
                finally:
                    self._writing = False
                if not ok:
                    # Outage: these stay in memory only; eviction spills them if Redis is back.
                    self._unpersisted.update(h for h, _ in batch if self.memory.contains(h))
                else:
                    self.written += len(batch)

    def _take_batch(self) -> list[tuple[bytes, bytes]]:
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        while self._pending and len(batch) < WRITE_BATCH_BLOCKS and size < WRITE_BATCH_BYTES:
            h, data = self._pending.popitem(last=False)
            self._pending_bytes -= len(data)
            size += len(data)
            batch.append((h, data))
        return batch

    async def _poll_forever(self) -> None:
        assert self.redis is not None
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.redis.poll()
            except Exception:  # noqa: BLE001 - the monitor must survive anything
                log.exception("Redis tier monitor failed")

    # ---- refill after a Redis restart -----------------------------------------------------------

    @property
    def refilling(self) -> bool:
        return self._refill_task is not None and not self._refill_task.done()

    def _start_refill(self) -> None:
        """Redis may be empty: (re)start the refill from the first block (called on the loop)."""
        if self._refill_task is not None:
            self._refill_task.cancel()
        self._refill_task = asyncio.get_running_loop().create_task(self._refill(), name="kv-redis-refill")

    async def _refill(self) -> None:
        hashes = self.memory.resident()
        written = 0
        for start in range(0, len(hashes), REFILL_BATCH_BLOCKS):
            items = await self._missing_in_redis(hashes[start:start + REFILL_BATCH_BLOCKS])
            if items is None:
                log.warning("Redis refill stopped after %d blocks: Redis failed again", written)
                return
            if items and not await self.redis.set_many(items):
                return
            written += len(items)
            self.refilled += len(items)
            self._unpersisted.difference_update(h for h, _ in items)
            # The rate bound: pause as long as these bytes take at refill_bytes_per_s.
            await asyncio.sleep(sum(len(d) for _, d in items) / self.refill_bytes_per_s)
        log.info("Redis refill done: %d of %d resident blocks were missing and written again", written, len(hashes))

    async def _missing_in_redis(self, batch: Sequence[bytes]) -> list[tuple[bytes, bytes]] | None:
        """(hash, data) of the blocks of `batch` still in memory that Redis lacks; None when Redis failed."""
        assert self.redis is not None
        errors = self.redis.errors
        present = await self.redis.exists_many(batch)
        if self.redis.errors != errors or not self.redis.up:
            return None
        datas = [(h, self.memory.peek(h)) for h, there in zip(batch, present) if not there]
        return [(h, d) for h, d in datas if d is not None]

    def _update_gauge(self) -> None:
        KVSTORE_BLOCKS.labels(tier="memory").set(self.memory.num_blocks)
