"""How KV blocks are named and counted, without torch: the content hashes of a prompt's blocks, and
how many blocks a length needs.

The gateway names prompts' blocks with it (a process that never holds a tensor, so it does not
import torch: ~1.4 s of its start and ~200 MB); `KVFormat`, the workers' block layout, names its
blocks through it, so the two cannot name a block differently.

The rule "the block holding the last token is always computed" lives here too (`reusable_blocks`):
that token's logits pick the next token, so its KV is never taken from a cache, whoever computed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.runtime.block_hash import block_hash, prompt_block_hashes
from pdserve.runtime.config import KV_DTYPE_NAMES


@dataclass(frozen=True, slots=True)
class BlockNames:
    """Whose blocks (the model's fingerprint and the --kv-dtype name, in every hash) of how many tokens."""

    fingerprint: str  # 32 hex chars identifying the model weights, config and compute dtype
    kv_dtype: str  # the --kv-dtype name
    block_size: int  # token slots per block

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"unsupported KV dtype {self.kv_dtype!r} (supported: {', '.join(KV_DTYPE_NAMES)})")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    # ---- counting -------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def reusable_blocks(self, num_tokens: int) -> int:
        """Leading full blocks of a sequence of `num_tokens` whose KV may come from a cache: all
        but the block of the last token, whose logits pick the next token."""
        return max(num_tokens - 1, 0) // self.block_size

    # ---- naming ---------------------------------------------------------------------------
    def block_hash(self, parent: bytes | None, token_ids: Sequence[int]) -> bytes:
        return block_hash(parent, token_ids, self.fingerprint, self.kv_dtype)

    def full_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of every full block of `token_ids`, in order."""
        return prompt_block_hashes(token_ids, self.block_size, self.fingerprint, self.kv_dtype)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of every block of `token_ids`, the partial tail (named by its own tokens) last."""
        return prompt_block_hashes(token_ids, self.block_size, self.fingerprint, self.kv_dtype,
                                   include_partial=True)

    def reusable_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of the leading full blocks a cache may supply (`reusable_blocks`)."""
        return self.full_block_hashes(token_ids)[:self.reusable_blocks(len(token_ids))]

    def kv_dtype_of(self, token_ids: Sequence[int], hashes: Sequence[bytes]) -> str | None:
        """The --kv-dtype under which `hashes` are the prompt's block hashes (this format's own
        first), or None when they are not (another model or block size)."""
        hashes = list(hashes)
        for name in (self.kv_dtype, *(n for n in KV_DTYPE_NAMES if n != self.kv_dtype)):
            if prompt_block_hashes(token_ids, self.block_size, self.fingerprint, name,
                                   include_partial=True) == hashes:
                return name
        return None
