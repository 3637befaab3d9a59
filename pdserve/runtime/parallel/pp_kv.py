"""Rank 0's view of a pipeline-parallel paged KV cache: its own layers, whole blocks on demand.

Each stage's cache `[num_blocks, layers_s, 2, rows, KVH, D]` holds only its layers. Blocks leave
and enter the engine in the canonical layout `[layers, 2, rows, KVH, D]` (all layers, all KV
heads), as `kv_shard.ShardedKVCache` does for tensor parallelism: `cache[block_id].clone()`
receives every stage's layers of the block and concatenates them, `cache[block_id].copy_(block)`
sends each stage its layers. With tensor parallelism inside the stages (rank s * N + t: stage s,
its tensor-parallel rank t) each rank holds its KV heads of its stage's layers, and a block's
heads are merged within each stage as `ShardedKVCache` does. So a PP-2 prefill worker's blocks are
read by a TP-1 decode worker as they are, and the reverse.
"""

from __future__ import annotations

import torch

from pdserve.runtime.parallel.kv_shard import CanonicalView, merge_heads
from pdserve.runtime.parallel.protocol import Channel, Op


class PipelineKVCache(CanonicalView):
    """The engine's `kv_cache` on rank 0 (stage 0) of a pipeline-parallel group."""

    def __init__(self, local: torch.Tensor, channel: Channel, ranges: tuple[tuple[int, int], ...],
                 kv_heads: list[tuple[int, int]], owners: list[int]) -> None:
        self.local = local  # [num_blocks, layers_0, 2, rows, KVH_t, D]: stage 0's layers, rank 0's heads
        self.channel = channel
        self.ranges = ranges  # every stage's [first, end) layer
        self.kv_heads = kv_heads  # per tensor-parallel rank t, its canonical KV heads [k0, k1)
        self.owners = owners  # per canonical KV head, the tensor-parallel rank its copy is read from
        self.block_shape = (ranges[-1][1], *local.shape[2:-2], len(owners), local.shape[-1])  # [L, 2, rows, KVH, D]

    def gather_block(self, block_id: int) -> torch.Tensor:
        """Block `block_id` with every layer: [L, 2, rows, KVH, D], a copy."""
        group, tp = self.channel.group, len(self.kv_heads)
        rest = self.local.shape[2:]
        stages = []
        with self.channel.lock:
            self.channel.send(Op.GET_BLOCK, block_id)
            for s, (a, b) in enumerate(self.ranges):
                parts = [self.local[block_id].clone() if s * tp + t == 0 else
                         group.recv(torch.empty((b - a, *rest), dtype=self.dtype, device=self.device), s * tp + t)
                         for t in range(tp)]
                stages.append(merge_heads(parts, self.owners) if tp > 1 else parts[0])
        return torch.cat(stages)

    def scatter_block(self, block_id: int, block: torch.Tensor) -> None:
        """Writes the canonical `block` [L, 2, rows, KVH, D] into every stage's layers of `block_id`."""
        block = block.to(device=self.device, dtype=self.dtype).contiguous()
        if tuple(block.shape) != self.block_shape:
            raise ValueError(f"KV block of shape {tuple(block.shape)}, expected {self.block_shape}")
        group, tp = self.channel.group, len(self.kv_heads)
        with self.channel.lock:
            self.channel.send(Op.PUT_BLOCK, block_id)
            for r in range(1, group.size):
                group.send(self._part(block, r // tp, r % tp), r)
        self.local[block_id].copy_(self._part(block, 0, 0))

    def _part(self, block: torch.Tensor, stage: int, t: int) -> torch.Tensor:
        """Rank (stage, t)'s part of a canonical block: its stage's layers, its KV heads."""
        (a, b), (k0, k1) = self.ranges[stage], self.kv_heads[t]
        return block[a:b, ..., k0:k1, :].contiguous()
