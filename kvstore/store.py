"""In-memory, content-addressed store of encoded KV blocks with LRU eviction and leases.

Keys are block content hashes, values the wire-encoded block bytes (opaque here). Blocks are
immutable: putting a hash that is already stored is a no-op. A *lease* (the request id) pins the
blocks it puts or gets so they survive eviction between prefill writing them and decode reading
them; it ends with `release` or, if its owner disappeared, `lease_ttl_s` after its last use.

A release is final: the lease id is remembered for `lease_ttl_s` after it (at most
MAX_ENDED_LEASES ids), and puts and gets under it meanwhile store and return blocks without
pinning them. Why: the gateway releases a cancelled request's lease at once, and a prefill
worker's put still in flight can reach the store after that release (the worker answered before
the cancel reached it, so it never releases itself); pinning then would hold those blocks for the
whole TTL with nobody left to end the lease. The cost: a request retried under the same id after
its lease ended (a Prefill retried on another worker) puts its blocks unpinned, so under memory
pressure its decode worker may find some evicted and compute them.

Only unpinned blocks are evicted, least recently used first (a put, a get hit, or the end of the
last pin counts as a use; `lookup` does not, so probing never keeps blocks alive). Capacity counts
block data bytes only.

Watermarks: when a put would take the data above `high_watermark * capacity`, unpinned blocks
are evicted until it fits under `low_watermark * capacity`, so that a burst of puts pays for one
eviction sweep instead of one eviction per put. Both default to 1.0 here (evict exactly what is
needed: the data structure on its own); the kvstore service's defaults, in process and from the
command line alike, are `kvstore.config.KVStoreConfig`'s (0.95 / 0.85). `on_evict(hash, data)` hears of every eviction (the Redis tier spills blocks it does not
hold yet).

Not thread-safe: the gRPC service calls it from its single asyncio event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class StoreFullError(Exception):
    """A put does not fit even after evicting every unpinned block."""


class PutOutcome(Enum):
    STORED = "stored"
    ALREADY_PRESENT = "already_present"


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Occupancy and counters of the store (mirrors pdserve.v1.KVStoreStats)."""

    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_pinned: int
    num_leases: int
    puts: int  # blocks newly stored
    gets: int  # blocks requested
    hits: int
    misses: int
    evictions: int
    bytes_in: int  # data bytes of accepted puts (stored or already present)
    bytes_out: int  # data bytes returned by gets
    backend_hits: int = 0  # memory misses found in the Redis tier (TieredStore only)
    backend_errors: int = 0  # failed Redis operations
    backend_up: bool = False  # a Redis tier is configured and answering


@dataclass(slots=True)
class _Entry:
    data: bytes
    pins: int = 0  # number of leases pinning the block
    owner: str = ""  # the lease that stored it ("" = none)
    shared: bool = False  # someone besides the owner put or got it: drop must keep it


@dataclass(slots=True)
class _Lease:
    expires_at: float
    # Pinned blocks in pin order (a dict, not a set, so release order and thus LRU order are
    # deterministic).
    blocks: dict[bytes, None] = field(default_factory=dict)


@dataclass(slots=True)
class _Counters:
    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


MAX_ENDED_LEASES = 1 << 18  # about 50 MB of remembered ids at worst; beyond it the oldest are forgotten


class MemoryBlockStore:
    """Content-addressed block store bounded by `capacity_bytes`; see the module docstring."""

    def __init__(self, capacity_bytes: int, lease_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, *, high_watermark: float = 1.0,
                 low_watermark: float = 1.0,
                 on_evict: Callable[[bytes, bytes], None] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark ({low_watermark}) <= high_watermark "
                             f"({high_watermark}) <= 1")
        self.capacity_bytes = capacity_bytes
        self.lease_ttl_s = lease_ttl_s
        self.high_bytes = int(capacity_bytes * high_watermark)
        self.low_bytes = int(capacity_bytes * low_watermark)
        self.on_evict = on_evict
        self._clock = clock
        self._blocks: dict[bytes, _Entry] = {}
        # Unpinned blocks only, least recently used first: eviction pops from the front in O(1).
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        # Ordered by expiry: the TTL is fixed, so a refreshed lease always moves to the end.
        self._leases: OrderedDict[str, _Lease] = OrderedDict()
        # Released lease ids -> when they are forgotten, oldest first (the TTL is fixed).
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._used_bytes = 0
        self._unpinned_bytes = 0
        self._counters = _Counters()

    # ---- public API -------------------------------------------------------------------------

    def put(self, block_hash: bytes, data: bytes, lease: str = "") -> PutOutcome:
        """Store `data` under `block_hash` (no-op if present), pinned under `lease` when given.

        Raises StoreFullError when the block cannot fit without evicting pinned blocks.
        """
        _check_hash(block_hash)
        self._expire_leases()
        lease = self._live(lease)
        entry = self._blocks.get(block_hash)
        if entry is not None:
            outcome = PutOutcome.ALREADY_PRESENT
            self._mark_use(block_hash, entry, lease)
        else:
            outcome = PutOutcome.STORED
            entry = self._insert(block_hash, bytes(data), lease)
            self._counters.puts += 1
        self._counters.bytes_in += len(entry.data)
        if lease:
            self._pin(lease, block_hash, entry)
        return outcome

    def get(self, hashes: Sequence[bytes], lease: str = "") -> list[bytes | None]:
        """Data of each hash in order (None when missing); hits are pinned under `lease` if given."""
        for block_hash in hashes:
            _check_hash(block_hash)
        self._expire_leases()
        lease = self._live(lease)
        found: list[bytes | None] = []
        for block_hash in hashes:
            entry = self._blocks.get(block_hash)
            found.append(None if entry is None else entry.data)
            if entry is None:
                continue
            self._mark_use(block_hash, entry, lease)
            if lease:
                self._pin(lease, block_hash, entry)
            self._counters.bytes_out += len(entry.data)
        hits = sum(data is not None for data in found)
        self._counters.gets += len(hashes)
        self._counters.hits += hits
        self._counters.misses += len(hashes) - hits
        if lease in self._leases:
            self._touch_lease(lease)  # any activity keeps a live lease alive, even all misses
        return found

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: bytes) -> bool:
        """Whether `block_hash` is held (no lease expiry, no use)."""
        return block_hash in self._blocks

    def resident(self) -> list[bytes]:
        """Hashes of every block held, a snapshot (no lease expiry, no use): the Redis refill's list."""
        return list(self._blocks)

    def peek(self, block_hash: bytes) -> bytes | None:
        """The data of `block_hash` if held, without counting a get or a use."""
        entry = self._blocks.get(block_hash)
        return None if entry is None else entry.data

    def presence(self, hashes: Iterable[bytes]) -> list[bool]:
        """Whether each hash is stored; does not count as a use."""
        self._expire_leases()
        return [block_hash in self._blocks for block_hash in hashes]

    def lookup(self, hashes: Iterable[bytes]) -> int:
        """Number of leading hashes that are stored (the reusable prefix)."""
        count = 0
        for present in self.presence(hashes):
            if not present:
                break
            count += 1
        return count

    def release(self, lease: str, drop: bool = False) -> int:
        """End `lease`: unpin its blocks and return how many it pinned.

        With `drop` (the cancel path), also delete its blocks that no other lease ever used
        and that nothing else pins. Puts and gets under `lease` pin nothing for `lease_ttl_s`
        after (a release is final, even of a lease not seen yet: see the module docstring).
        """
        self._expire_leases()
        self._end(lease)
        record = self._leases.pop(lease, None)
        if record is None:
            return 0
        for block_hash in record.blocks:
            entry = self._blocks[block_hash]
            self._unpin(block_hash, entry)
            if drop and entry.owner == lease and not entry.shared and entry.pins == 0:
                self._delete(block_hash)
        return len(record.blocks)

    def stats(self) -> StoreStats:
        self._expire_leases()
        c = self._counters
        return StoreStats(
            capacity_bytes=self.capacity_bytes, used_bytes=self._used_bytes,
            num_blocks=len(self._blocks), num_pinned=len(self._blocks) - len(self._lru),
            num_leases=len(self._leases), puts=c.puts, gets=c.gets, hits=c.hits,
            misses=c.misses, evictions=c.evictions, bytes_in=c.bytes_in, bytes_out=c.bytes_out)

    def check_consistency(self) -> None:
        """Assert the internal bookkeeping adds up (tests call it to catch leaks)."""
        assert self._used_bytes == sum(len(e.data) for e in self._blocks.values()), "used_bytes drift"
        assert self._used_bytes <= self.capacity_bytes, "over capacity"
        pins: dict[bytes, int] = {}
        for record in self._leases.values():
            for block_hash in record.blocks:
                assert block_hash in self._blocks, "lease pins a deleted block"
                pins[block_hash] = pins.get(block_hash, 0) + 1
        for block_hash, entry in self._blocks.items():
            assert entry.pins == pins.get(block_hash, 0), f"pin count drift on {block_hash.hex()}"
            assert (entry.pins == 0) == (block_hash in self._lru), "LRU holds a pinned block"
        assert set(self._lru) <= set(self._blocks), "LRU holds a deleted block"
        unpinned = sum(len(self._blocks[h].data) for h in self._lru)
        assert self._unpinned_bytes == unpinned, "unpinned_bytes drift"

    # ---- internals ----------------------------------------------------------------------------

    def _insert(self, block_hash: bytes, data: bytes, lease: str) -> _Entry:
        self._make_room(len(data))
        entry = _Entry(data=data, owner=lease)
        self._blocks[block_hash] = entry
        self._lru[block_hash] = None
        self._used_bytes += len(data)
        self._unpinned_bytes += len(data)
        return entry

    def _make_room(self, size: int) -> None:
        pinned_bytes = self._used_bytes - self._unpinned_bytes
        # Check first so a put that cannot succeed does not evict anything on its way out.
        if pinned_bytes + size > self.capacity_bytes:
            raise StoreFullError(
                f"block of {size} bytes does not fit: {pinned_bytes} of {self.capacity_bytes} "
                f"bytes are pinned by {len(self._leases)} leases")
        if self._used_bytes + size <= self.high_bytes:
            return
        # Above the high watermark: sweep down to the low one (or as far as unpinned blocks
        # allow; the hard limit is the capacity, which the pinned check above guarantees).
        while self._lru and (self._used_bytes + size > self.low_bytes
                             or self._used_bytes + size > self.capacity_bytes):
            victim, _ = self._lru.popitem(last=False)
            data = self._blocks[victim].data
            self._delete(victim, in_lru=False)
            self._counters.evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim, data)

    def _delete(self, block_hash: bytes, in_lru: bool = True) -> None:
        entry = self._blocks.pop(block_hash)
        if in_lru:
            del self._lru[block_hash]
        self._used_bytes -= len(entry.data)
        self._unpinned_bytes -= len(entry.data)

    def _mark_use(self, block_hash: bytes, entry: _Entry, user: str) -> None:
        if user != entry.owner or not user:
            entry.shared = True
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def _pin(self, lease: str, block_hash: bytes, entry: _Entry) -> None:
        record = self._touch_lease(lease)
        if block_hash in record.blocks:
            return
        record.blocks[block_hash] = None
        if entry.pins == 0:
            del self._lru[block_hash]
            self._unpinned_bytes -= len(entry.data)
        entry.pins += 1

    def _unpin(self, block_hash: bytes, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0:
            self._lru[block_hash] = None  # most recently used: its reader just finished
            self._unpinned_bytes += len(entry.data)

    def _touch_lease(self, lease: str) -> _Lease:
        """Create or refresh `lease`, moving its expiry to now + TTL."""
        expires_at = self._clock() + self.lease_ttl_s
        record = self._leases.get(lease)
        if record is None:
            record = self._leases[lease] = _Lease(expires_at)
        else:
            record.expires_at = expires_at
            self._leases.move_to_end(lease)
        return record

    def _live(self, lease: str) -> str:
        """`lease`, or "" (no pin) when it was released within the TTL: a release is final."""
        return "" if lease in self._ended else lease

    def _end(self, lease: str) -> None:
        self._ended.pop(lease, None)
        self._ended[lease] = self._clock() + self.lease_ttl_s
        if len(self._ended) > MAX_ENDED_LEASES:
            self._ended.popitem(last=False)

    def _expire_leases(self) -> None:
        now = self._clock()
        while self._ended and next(iter(self._ended.values())) <= now:
            self._ended.popitem(last=False)
        while self._leases:
            lease, record = next(iter(self._leases.items()))
            if record.expires_at > now:
                break
            del self._leases[lease]
            for block_hash in record.blocks:
                self._unpin(block_hash, self._blocks[block_hash])


def _check_hash(block_hash: bytes) -> None:
    if not block_hash:
        raise ValueError("block hash is empty")
