"""BlockManager with exact block ids: allocation, prefix sharing, LRU eviction, leak check."""

from __future__ import annotations

import pytest

from pdserve.runtime.block_manager import BlockManager, KVLeakError
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import Sequence

BS = 4
FORMAT = KVFormat.named("0" * 32, "float32", num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)


def seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def computed(bm: BlockManager, s: Sequence) -> Sequence:
    """Marks every token computed, as after a prefill step, and hashes the full blocks."""
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    return s


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(num_blocks=6, kv_format=FORMAT)


def test_allocation_takes_free_blocks_in_order(bm):
    a = seq("a", list(range(10)))  # 3 blocks: 4 + 4 + 2
    assert bm.allocate(a) == []  # no KV from elsewhere to load
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 3
    bm.check_leaks([a])


def test_a_freed_unhashed_block_is_the_next_one_taken(bm):
    """Its pages are resident already (the CPU cache is mapped lazily: kv_cache.zero_pages), where
    a never-used block would cost fresh memory."""
    a = seq("a", list(range(10)))  # blocks 0, 1, 2; none hashed (not computed)
    bm.allocate(a)
    bm.free(a)
    b = seq("b", list(range(100, 105)))  # 2 blocks
    bm.allocate(b)
    assert b.block_table == [0, 1]
    bm.check_leaks([b])


def test_prefix_sharing_exact_ids(bm):
    a = seq("a", list(range(10)))
    bm.allocate(a)
    computed(bm, a)  # blocks 0 and 1 are full and hashed; block 2 holds the partial tail
    b = seq("b", list(range(8)) + [99, 98, 97])  # same first two blocks, different tail
    assert bm.allocate(b) == []  # no KV from elsewhere to load
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    assert b.block_table[2] == 3
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    bm.check_leaks([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_leaks([])
    assert bm.num_cached_blocks == 2  # the hashed full blocks stay cached


def test_cached_blocks_are_evicted_least_recently_used_first(bm):
    a, b = seq("a", list(range(8))), seq("b", list(range(100, 108)))
    for s in (a, b):
        bm.allocate(s)
        computed(bm, s)
    bm.free(a)  # a's blocks 1, 0 become cached first (released tail first)
    bm.free(b)
    assert list(bm._cached) == [1, 0, 3, 2]
    c = seq("c", list(range(200, 212)))  # needs 3 blocks: free 4, 5, then evicts LRU block 1
    assert bm.allocate(c) == []  # no KV from elsewhere to load
    assert c.block_table == [4, 5, 1]
    assert bm.lookup(a.block_hashes[1]) is None and bm.lookup(a.block_hashes[0]) == 0
    bm.free(c)
    bm.check_leaks([])


def test_allocation_fails_cleanly_when_out_of_blocks(bm):
    a = seq("a", list(range(24)))  # exactly 6 blocks
    assert bm.allocate(a) == []  # no KV from elsewhere to load
    b = seq("b", [1, 2])
    assert bm.allocate(b) is None and b.block_table == []
    bm.check_leaks([a])


def test_leak_check_catches_a_missing_release(bm):
    a = seq("a", list(range(6)))
    bm.allocate(a)
    with pytest.raises(KVLeakError, match="ref counts differ"):
        bm.check_leaks([])  # a still holds blocks nobody accounts for
