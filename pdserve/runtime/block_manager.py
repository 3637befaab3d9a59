"""BlockManager: owns the KV blocks of one cache: free list, reference counts, prefix cache.

A block is free (never hashed, or its hash dropped), referenced (in some sequence's block
table, or pinned: pdserve.runtime.pins), or cached (hashed, unreferenced, evictable in LRU order).
Full blocks whose KV is computed get their content hash and can be shared by any sequence with
the same prefix; the partial tail block belongs to its sequence alone.

KV computed elsewhere enters here, when the scheduler admits a sequence: `allocate` shares the
leading blocks the cache holds, takes fresh blocks for the ones the sequence brought
(`Sequence.external`) and returns them as `BlockLoad`s, which the engine copies into the paged
cache before the step that first runs the sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pdserve.runtime import engine_metrics
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.sequence import Sequence


class KVLeakError(AssertionError):
    """Free + cached + referenced blocks do not add up, or a ref count is off."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Copy `data` (KV from elsewhere, [layers, 2, rows, KVH, D]) into block `block_id`."""

    block_id: int
    data: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Plan:
    """How a sequence's leading blocks are filled: shared from the cache or loaded."""

    hashes: list[bytes]  # of the leading full blocks the sequence gets without computing
    shared: list[int | None]  # per leading full block: its cached block id, or None (loaded)
    loads: list[torch.Tensor]  # data of the loaded full blocks, in order
    tail: torch.Tensor | None  # the prompt's partial last block, loaded too
    fresh: int  # blocks to take (loads included)


class BlockManager:
    def __init__(self, num_blocks: int, kv_format: KVFormat) -> None:
        self.format = kv_format
        self.block_size = kv_format.block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, LRU first
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached ones)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup(self, hash_: bytes) -> int | None:
        return self._by_hash.get(hash_)

    def is_resident(self, hash_: bytes) -> bool:
        """One dict lookup: safe to call from another thread as a hint (the answer may be stale)."""
        return hash_ in self._by_hash

    def resident_hashes(self) -> frozenset[bytes]:
        """Hashes of every full block whose KV this cache holds (referenced or cached)."""
        return frozenset(self._by_hash)

    def allocate(self, seq: Sequence) -> list[BlockLoad] | None:
        """Gives `seq` blocks for all its tokens: its leading full blocks shared from the cache or
        loaded from `seq.external`, the rest fresh. Returns the loads to copy in (then `external`
        is dropped), or None with nothing taken when the cache is short."""
        plan = self._plan(seq)
        if plan.fresh > self.num_free_blocks - sum(1 for b in plan.shared if b is not None and b in self._cached):
            return None
        engine_metrics.count_prefix_lookup(seq.num_tokens, sum(b is not None for b in plan.shared) * self.block_size)
        hashes = plan.hashes
        table, loads = [], []
        for bid in plan.shared:
            if bid is not None:
                self._ref(bid)  # before any take: a take must not evict what we share
        data = iter(plan.loads)
        for h, bid in zip(hashes, plan.shared):
            if bid is None:
                bid = self._take()
                self.register(bid, h)
                loads.append(BlockLoad(bid, next(data)))
            table.append(bid)
        if plan.tail is not None:
            table.append(self._take())
            loads.append(BlockLoad(table[-1], plan.tail))
        table.extend(self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(table)))
        seq.block_table = table
        seq.block_hashes = hashes
        seq.num_cached_tokens = len(hashes) * self.block_size
        seq.num_computed_tokens = len(seq.prompt_ids) if plan.tail is not None else seq.num_cached_tokens
        seq.external = None
        return loads

    def shortfall(self, seq: Sequence) -> int:
        """Blocks `allocate(seq)` lacks now (0 when it would succeed)."""
        plan = self._plan(seq)
        return max(plan.fresh - self.num_free_blocks
                   + sum(1 for b in plan.shared if b is not None and b in self._cached), 0)

    def _plan(self, seq: Sequence) -> _Plan:
        external = seq.external.blocks if seq.external is not None else {}
        hashes, shared, loads = [], [], []
        for h in self.format.reusable_hashes(seq.token_ids):
            bid = self._by_hash.get(h)
            if bid is None and h not in external:
                break  # a gap: computed from here on
            hashes.append(h)
            shared.append(bid)
            if bid is None:
                loads.append(external[h])
        tail = None
        tail_hash = seq.external.tail if seq.external is not None else None
        if tail_hash in external and len(shared) == len(seq.prompt_ids) // self.block_size:
            tail = external[tail_hash]  # the whole prompt came: its tail too
        fresh = self.blocks_for(seq.num_tokens) - sum(1 for b in shared if b is not None)
        return _Plan(hashes, shared, loads, tail, fresh)

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows the block table to hold `num_tokens` tokens; False when out of blocks."""
        extra = self.blocks_for(num_tokens) - len(seq.block_table)
        if extra > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(max(extra, 0)))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Releases the blocks of `seq` past those `num_tokens` tokens need: slots of rejected draft
        tokens (speculative decoding). They hold no computed token, so none is hashed."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def take_blocks(self, count: int) -> list[int] | None:
        """Hands out `count` fresh blocks (ref 1 each), or None when there are not enough."""
        if count > self.num_free_blocks:
            return None
        return [self._take() for _ in range(count)]

    def ref_cached(self, hash_: bytes) -> int | None:
        """Takes a reference on the cached block with this hash, if there is one."""
        bid = self._by_hash.get(hash_)
        if bid is not None:
            self._ref(bid)
        return bid

    def commit_full_blocks(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """Hashes the blocks of `seq` that became full and computed; returns (block, hash) new."""
        committed = []
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        tokens = seq.token_ids
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.format.block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if self.blocks[bid].hash is None and h not in self._by_hash:
                self.blocks[bid].hash = h
                self._by_hash[h] = bid
            committed.append((bid, h))
        return committed

    def register(self, bid: int, hash_: bytes) -> None:
        """Marks block `bid` (whose KV was loaded from elsewhere) as holding `hash_`."""
        if hash_ not in self._by_hash and self.blocks[bid].hash is None:
            self.blocks[bid].hash = hash_
            self._by_hash[hash_] = bid

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block; unreferenced hashed blocks stay cached (LRU)."""
        for bid in reversed(list(block_ids)):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise KVLeakError(f"block {bid} released more often than referenced")
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached[bid] = None
                else:  # next to be taken: its pages are resident already (kv_cache.zero_pages)
                    self._free.appendleft(bid)

    def _ref(self, bid: int) -> None:
        self._cached.pop(bid, None)
        self.blocks[bid].ref_count += 1

    def _take(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:
            bid, _ = self._cached.popitem(last=False)  # evict the least recently used
            block = self.blocks[bid]
            del self._by_hash[block.hash]
            block.hash = None
        self.blocks[bid].ref_count = 1
        return bid

    def check_leaks(self, live: Iterable[Sequence] = (), pinned: Iterable[int] = ()) -> None:
        """Raises KVLeakError unless ref counts match the live tables plus the pins (one block id
        per pin) and all blocks add up."""
        expected = [0] * self.num_blocks
        for seq in live:
            for bid in seq.block_table:
                expected[bid] += 1
        for bid in pinned:
            expected[bid] += 1
        actual = [b.ref_count for b in self.blocks]
        if expected != actual:
            bad = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a][:8]
            raise KVLeakError(f"ref counts differ from live block tables and pins at blocks {bad}")
        referenced = sum(1 for r in actual if r > 0)
        if len(self._free) + len(self._cached) + referenced != self.num_blocks:
            raise KVLeakError(
                f"free {len(self._free)} + cached {len(self._cached)} + referenced {referenced}"
                f" != total {self.num_blocks}")
