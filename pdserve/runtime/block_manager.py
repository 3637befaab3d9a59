"""BlockManager: owns the KV blocks of one cache: free list, reference counts, prefix cache.

A block is free (never hashed, or its hash dropped), referenced (in some sequence's block
table), or cached (hashed, unreferenced, evictable in LRU order). Full blocks whose KV is
computed get their content hash and can be shared by any sequence with the same prefix;
the partial tail block belongs to its sequence alone.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.runtime.block_hash import block_hash, prompt_block_hashes
from pdserve.runtime.sequence import Sequence


class KVLeakError(AssertionError):
    """Free + cached + referenced blocks do not add up, or a ref count is off."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str, kv_dtype: str) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
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

    def resident_hashes(self) -> set[bytes]:
        """Hashes of every full block whose KV this cache holds (referenced or cached)."""
        return set(self._by_hash)

    def allocate(self, seq: Sequence) -> bool:
        """Gives `seq` blocks for all its tokens, reusing cached prefix blocks; False if short."""
        hashes = prompt_block_hashes(seq.token_ids, self.block_size, self.fingerprint, self.kv_dtype)
        reused = self._cached_prefix(hashes)
        if len(reused) * self.block_size >= seq.num_tokens:
            reused.pop()  # the last token is always computed: its logits pick the next token
        needed = self.blocks_for(seq.num_tokens) - len(reused)
        if needed > self.num_free_blocks - sum(1 for b in reused if b in self._cached):
            return False
        for bid in reused:
            self._ref(bid)
        seq.block_table = reused + [self._take() for _ in range(needed)]
        seq.block_hashes = hashes[:len(reused)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(reused) * self.block_size
        return True

    def _cached_prefix(self, hashes: list[bytes]) -> list[int]:
        reused = []
        for h in hashes:
            bid = self._by_hash.get(h)
            if bid is None:
                break
            reused.append(bid)
        return reused

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows the block table to hold `num_tokens` tokens; False when out of blocks."""
        extra = self.blocks_for(num_tokens) - len(seq.block_table)
        if extra > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take() for _ in range(max(extra, 0)))
        return True

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
            h = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size],
                           self.fingerprint, self.kv_dtype)
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
                else:
                    self._free.append(bid)

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

    def check_leaks(self, live: Iterable[Sequence] = ()) -> None:
        """Raises KVLeakError unless ref counts match the live tables and all blocks add up."""
        expected = [0] * self.num_blocks
        for seq in live:
            for bid in seq.block_table:
                expected[bid] += 1
        actual = [b.ref_count for b in self.blocks]
        if expected != actual:
            bad = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a][:8]
            raise KVLeakError(f"ref counts differ from live block tables at blocks {bad}")
        referenced = sum(1 for r in actual if r > 0)
        if len(self._free) + len(self._cached) + referenced != self.num_blocks:
            raise KVLeakError(
                f"free {len(self._free)} + cached {len(self._cached)} + referenced {referenced}"
                f" != total {self.num_blocks}")
