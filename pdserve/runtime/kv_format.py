"""KVFormat: the one identity and layout of a KV block, shared by every part that names blocks.

A block's identity is its content hash: hash(parent block's hash, the block's tokens, model
fingerprint, KV storage format), so equal hashes mean equal KV (pdserve.runtime.block_hash). Its
layout is `[num_layers, 2, rows, num_kv_heads, head_dim]` (rows = block_size, one more for the
scale row of int8 / fp8). The workers and `BlockManager` hash what they compute with it (the gateway
hashes prompts with its `names`), `kvwire` checks a block's header against it.

Naming and counting (and the rule "the block holding the last token is always computed") are
`runtime.block_names`', which the gateway uses without torch; KVFormat names its blocks through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.runtime.block_names import BlockNames
from pdserve.runtime.kv_cache import KV_DTYPES, cache_rows, dtype_of, format_name


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What a block is made of and how it is named: the model that made it and the cache layout."""

    fingerprint: str  # 32 hex chars identifying the model weights, config and compute dtype
    dtype: torch.dtype  # storage dtype of the cache (one of kv_cache.KV_DTYPES' values)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # token slots per block
    # How its blocks are named and counted (the torch-free part the gateway shares): built once here,
    # not on each hash (the workers hash a block each 16 tokens of every sequence).
    names: BlockNames = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES.values():
            raise ValueError(f"unsupported KV dtype {self.dtype} (supported: {', '.join(KV_DTYPES)})")
        object.__setattr__(self, "names", BlockNames(self.fingerprint, format_name(self.dtype), self.block_size))

    @classmethod
    def named(cls, fingerprint: str, kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
              block_size: int) -> "KVFormat":
        """The format with the --kv-dtype name `kv_dtype`."""
        return cls(fingerprint, dtype_of(kv_dtype), num_layers, num_kv_heads, head_dim, block_size)

    # ---- layout ---------------------------------------------------------------------------
    @property
    def kv_dtype(self) -> str:
        """The --kv-dtype name, part of every block hash."""
        return self.names.kv_dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[layers, 2, rows, KVH, D]: rows = block_size, + 1 scale row for int8 / fp8."""
        return (self.num_layers, 2, cache_rows(self.block_size, self.dtype), self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()

    def with_kv_dtype(self, name: str) -> "KVFormat":
        return dataclasses.replace(self, dtype=dtype_of(name))

    # ---- naming and counting: `names` (runtime.block_names) -----------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return self.names.blocks_for(num_tokens)

    def reusable_blocks(self, num_tokens: int) -> int:
        return self.names.reusable_blocks(num_tokens)

    def block_hash(self, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        return self.names.block_hash(parent, token_ids)

    def full_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.names.full_block_hashes(token_ids)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.names.prompt_hashes(token_ids)

    def reusable_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return self.names.reusable_hashes(token_ids)

    def kv_dtype_of(self, token_ids: Sequence[int], hashes: Sequence[bytes]) -> str | None:
        return self.names.kv_dtype_of(token_ids, hashes)
