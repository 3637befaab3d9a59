"""The paged KV cache tensor: one block of one sequence is one contiguous slab.

Layout `[num_blocks, layers, 2, block_size, KVH, D]` (2 = keys, values), so a block is a
single value in the KV store and a single copy on the wire.
"""

from __future__ import annotations

import torch

from pdserve.runtime.config import CacheConfig, ModelConfig


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV cache dtype {name!r}")
    return dtype


def allocate_kv_cache(model: ModelConfig, cache: CacheConfig, device: str) -> torch.Tensor:
    shape = (cache.num_blocks, model.num_layers, 2, cache.block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype_of(cache.dtype), device=device)


def block_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    """Shape of one block: [layers, 2, block_size, KVH, D]."""
    return (model.num_layers, 2, cache.block_size, model.num_kv_heads, model.head_dim)
