"""The kvstore's optional second tier: encoded KV blocks in Redis, reached with `redis.asyncio`.

Redis is a cache here, never a dependency: every method answers "not found" / "not stored"
instead of raising when Redis is down, refuses connections or times out. The first failure of an
outage logs one warning, every failed operation counts in `pdserve_kvstore_backend_errors_total`,
and for `retry_interval_s` after a failure no call even tries (requests do not each pay a
connect timeout). After that the next call, or the background monitor, tries again, and the first
success logs that Redis is back and puts it to use again.

A Redis that comes back may have lost everything (ours run without persistence; a crash or an OOM
kill loses whatever was not saved). `on_restart` hears of it: when Redis answers again after an
outage, and when the background poll sees a new `run_id` (a restart between two polls that no call
noticed). The TieredStore then re-writes what its memory tier holds (kvstore.tiered).

Keys are `pdkv:<16-byte block hash>` (binary), values the wire-encoded block. Batches cost one
round trip: one pipeline of SETs, one pipeline of MGETs of at most MGET_BYTES each (a long
conversation of a model with 128 KiB of KV per token is ~100 MB: in one MGET its reply alone would
outlast the socket timeout on a busy host, and the outage back-off would then turn every block
into a miss; per-MGET replies each get the timeout). Redis evicts on its own
(run it with `maxmemory` and `maxmemory-policy allkeys-lru`: see docs/kvstore.md); a key it
evicted is simply a miss here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvstore.metrics import KVSTORE_BACKEND_ERRORS, KVSTORE_BLOCKS, KVSTORE_EVICTIONS
from pdserve import log_privacy

log = logging.getLogger(__name__)
T = TypeVar("T")

KEY_PREFIX = b"pdkv:"
MGET_BYTES = 8 << 20  # target reply size of one MGET (estimated from the largest block seen)


def block_key(block_hash: bytes) -> bytes:
    return KEY_PREFIX + block_hash


class RedisTier:
    """Blocks in the Redis at `url` (`redis://host:port/db`); see the module docstring."""

    def __init__(self, url: str, *, timeout_s: float = 0.5, retry_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        # No client-side retries: a failure is reported at once and the tier backs off instead.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, decode_responses=False)
        self._down_since: float | None = None  # start of the current outage
        self._retry_at = 0.0  # no attempts before this time while down
        self.errors = 0
        self.hits = 0
        self._evicted_keys: int | None = None  # Redis's own eviction count at the last poll
        self._block_bytes = 0  # largest value written or read so far: sizes the MGETs
        self._run_id: str | None = None  # Redis's INFO run_id at the last poll (None: unknown)
        # Called (on the event loop) when Redis may have come back empty; see the module docstring.
        self.on_restart: Callable[[], None] | None = None

    @property
    def up(self) -> bool:
        return self._down_since is None

    # ---- block operations (never raise for Redis trouble) ----------------------------------

    async def get_many(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        """Data of each hash (None: missing, or Redis unavailable)."""
        if not hashes:
            return []
        keys = [block_key(h) for h in hashes]
        per_get = max(1, MGET_BYTES // self._block_bytes) if self._block_bytes else len(keys)

        async def run() -> list[bytes | None]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for i in range(0, len(keys), per_get):
                    pipe.mget(keys[i:i + per_get])
                return [d for part in await pipe.execute() for d in part]
        found = await self._call(run)
        if found is None:
            return [None] * len(hashes)
        self.hits += sum(d is not None for d in found)
        self._block_bytes = max([self._block_bytes, *(len(d) for d in found if d is not None)])
        return found

    async def exists_many(self, hashes: Sequence[bytes]) -> list[bool]:
        """Whether each hash is in Redis (False when Redis is unavailable)."""
        if not hashes:
            return []

        async def run() -> list[int]:
            async with self._redis.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.exists(block_key(h))
                return await pipe.execute()
        answers = await self._call(run)
        return [bool(a) for a in answers] if answers is not None else [False] * len(hashes)

    async def set_many(self, items: Sequence[tuple[bytes, bytes]]) -> bool:
        """Store the (hash, data) pairs in one pipeline; False when Redis was unavailable."""
        if not items:
            return True

        async def run() -> list:
            async with self._redis.pipeline(transaction=False) as pipe:
                for h, data in items:
                    pipe.set(block_key(h), data)
                return await pipe.execute()
        self._block_bytes = max(self._block_bytes, *(len(d) for _, d in items))
        return await self._call(run) is not None

    async def poll(self) -> None:
        """Refresh the Redis gauges (block count, its own evictions); doubles as the outage probe
        and the restart detector (a new run_id)."""
        async def run() -> tuple[int, dict, dict]:
            return await self._redis.dbsize(), await self._redis.info("stats"), await self._redis.info("server")
        answer = await self._call(run, force=True)
        if answer is None:
            return
        size, stats, server = answer
        self._check_run_id(str(server.get("run_id", "")))
        KVSTORE_BLOCKS.labels(tier="redis").set(size)
        evicted = int(stats.get("evicted_keys", 0))
        if self._evicted_keys is not None and evicted > self._evicted_keys:
            KVSTORE_EVICTIONS.labels(tier="redis").inc(evicted - self._evicted_keys)
        self._evicted_keys = evicted

    async def close(self) -> None:
        await self._redis.aclose()

    def _check_run_id(self, run_id: str) -> None:
        known, self._run_id = self._run_id, run_id
        if known is not None and run_id != known:
            log.warning("Redis tier %s restarted (new run_id): it may have lost its blocks",
                        log_privacy.url(self.url))
            self._restarted()

    def _restarted(self) -> None:
        if self.on_restart is not None:
            self.on_restart()

    # ---- outage handling -------------------------------------------------------------------

    async def _call(self, fn: Callable[[], Awaitable[T]], force: bool = False) -> T | None:
        """fn()'s answer, or None when Redis failed or is in its back-off after a failure."""
        if not self.up and not force and self._clock() < self._retry_at:
            return None
        try:
            result = await fn()
        except (RedisError, OSError, asyncio.TimeoutError) as err:
            self._failed(err)
            return None
        if not self.up:
            log.warning("Redis tier %s is back after %.1f s: using it again", log_privacy.url(self.url),
                        self._clock() - self._down_since)
            self._down_since = None
            self._run_id = None  # the next poll learns the new one without reporting it again
            self._restarted()
        return result

    def _failed(self, err: BaseException) -> None:
        self.errors += 1
        KVSTORE_BACKEND_ERRORS.inc()
        now = self._clock()
        if self.up:
            log.warning("Redis tier %s unavailable (%s: %s): serving from memory until it is back",
                        log_privacy.url(self.url), type(err).__name__, err)
            self._down_since = now
        self._retry_at = now + self.retry_interval_s
