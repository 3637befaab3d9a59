"""Rank 0's view of a tensor-parallel paged KV cache: its own shard, whole blocks on demand.

Each rank's cache `[num_blocks, layers, 2, rows, KVH_rank, D]` holds the KV heads its query heads
read. Blocks leave and enter the engine in the canonical layout (all KVH heads), whatever the
degree: `cache[block_id].clone()` gathers the block's heads from the ranks (the first holder of
each KV head, replicas skipped), `cache[block_id].copy_(block)` broadcasts a canonical block and
each rank keeps its heads. That is the whole interface the engine uses of its cache (KV
transfer's exports and imports, the scheduler's loads), so a TP-2 prefill worker's blocks are read
by a TP-1 decode worker as they are, and the reverse. A scaled format's scale row keeps each
head's scale in that head's slot, so it splits and joins with the heads.
"""

from __future__ import annotations

import torch

from pdserve.runtime.parallel.group import TPGroup
from pdserve.runtime.parallel.protocol import Channel, Op, recv_bytes, send_bytes


class CanonicalView:
    """What the engine reads of a kv_cache tensor, for a cache whose blocks live on several ranks:
    `local` (rank 0's part, [num_blocks, ...]) and `block_shape` (a whole block, canonical layout);
    indexing gives a CanonicalBlock, which the subclass's gather_block/scatter fill."""

    local: torch.Tensor
    block_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.local.shape[0], *self.block_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def __len__(self) -> int:
        return self.local.shape[0]

    def __getitem__(self, block_id: int) -> CanonicalBlock:
        return CanonicalBlock(self, int(block_id))


class ShardedKVCache(CanonicalView):
    """The engine's `kv_cache` on rank 0 of a tensor-parallel group."""

    def __init__(self, local: torch.Tensor, channel: Channel, kv_heads: tuple[int, int], owners: list[int]) -> None:
        self.local = local  # [num_blocks, layers, 2, rows, KVH_rank, D]: this rank's heads
        self.channel = channel
        self.kv_heads = kv_heads  # the canonical KV heads rank 0 holds, [k0, k1)
        self.owners = owners  # per canonical KV head, the rank its copy is read from
        self.block_shape = (*local.shape[1:-2], len(owners), local.shape[-1])  # canonical [L, 2, rows, KVH, D]

    def gather_block(self, block_id: int) -> torch.Tensor:
        """Block `block_id` with every KV head: [L, 2, rows, KVH, D], a copy."""
        group = self.channel.group
        with self.channel.lock:
            self.channel.send(Op.GET_BLOCK, block_id)
            parts = group.gather(self.local[block_id].contiguous())
        assert parts is not None
        return merge_heads(parts, self.owners)

    def scatter_block(self, block_id: int, block: torch.Tensor) -> None:
        """Writes the canonical `block` [L, 2, rows, KVH, D] into every rank's shard of `block_id`."""
        block = block.to(device=self.device, dtype=self.dtype).contiguous()
        if tuple(block.shape) != self.block_shape:
            raise ValueError(f"KV block of shape {tuple(block.shape)}, expected {self.block_shape}")
        with self.channel.lock:
            self.channel.send(Op.PUT_BLOCK, block_id, block.numel() * block.element_size())
            send_bytes(self.channel.group, block)
        store_heads(self.local, block_id, block, self.kv_heads)


class CanonicalBlock:
    """`cache[block_id]`: what the engine does with a block (copy it out, copy into it)."""

    __slots__ = ("cache", "block_id")

    def __init__(self, cache: ShardedKVCache, block_id: int) -> None:
        self.cache, self.block_id = cache, block_id

    def clone(self) -> torch.Tensor:
        return self.cache.gather_block(self.block_id)

    def copy_(self, block: torch.Tensor) -> None:
        self.cache.scatter_block(self.block_id, block)


def merge_heads(parts: list[torch.Tensor], owners: list[int]) -> torch.Tensor:
    """Per-rank shards [L, 2, rows, KVH_rank, D] -> the canonical block [L, 2, rows, KVH, D]."""
    seen: dict[int, int] = {}  # rank -> heads of it taken so far
    heads = []
    for r in owners:
        j = seen.get(r, 0)
        heads.append(parts[r][..., j:j + 1, :])
        seen[r] = j + 1
    return torch.cat(heads, dim=-2)


def store_heads(local: torch.Tensor, block_id: int, block: torch.Tensor, kv_heads: tuple[int, int]) -> None:
    local[block_id].copy_(block[..., kv_heads[0]:kv_heads[1], :])


def receive_block(local: torch.Tensor, group: TPGroup, block_id: int, nbytes: int, kv_heads: tuple[int, int],
                  canonical_shape: tuple[int, ...]) -> None:
    """A follower's side of PUT_BLOCK: the canonical block from rank 0, its heads kept."""
    block = recv_bytes(group, nbytes, local.dtype, canonical_shape)
    store_heads(local, block_id, block, kv_heads)
