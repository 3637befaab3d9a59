"""Metadata of one engine step's attention: which tokens decode, which prefill, where KV goes.

Token order in a step: all decode tokens first (one per sequence), then each prefill
sequence's new tokens as one contiguous run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One sequence's chunk of new tokens attending to its cached prefix plus itself."""

    query_start: int  # index of the chunk's first token in the step
    query_len: int
    context_len: int  # cached prefix + this chunk
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64: block_id * block_size + offset of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    decode_context_lens: torch.Tensor  # [B] int64
    prefills: tuple[PrefillSpan, ...]
    # [N] bool: rows of tokens the model generated (not prompt tokens); None: not told. Read by
    # fp32 int4 projections, which run generated tokens on their kernel (quant.int4_cpu.token_kinds).
    generated_rows: torch.Tensor | None = None
