"""Metadata of one engine step's attention: which tokens decode, which prefill, where KV goes.

Token order in a step: all decode tokens first (one per sequence), then each prefill
sequence's new tokens as one contiguous run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # int4 projections (fp32; bf16 with the VNNI GEMM), which run generated tokens on their int8 kernels
    # (quant.int4_cpu.token_kinds).
    generated_rows: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class RowSplit:
    """A step's rows in two parts: the decode rows of generated tokens (`decode`) and the rest
    (`rest`: prompt chunks, and a resumed request's last prompt token run as a decode)."""

    decode_rows: torch.Tensor  # [G] int64: rows of the step in `decode`, in order
    decode: AttentionMetadata
    rest_rows: torch.Tensor  # [N - G] int64: rows of the step in `rest`, in order
    rest: AttentionMetadata


def split_generated_decodes(meta: AttentionMetadata) -> RowSplit | None:
    """`meta` as two steps, its generated decode rows and the others (each sequence's rows are in one
    of them, so the two write and read disjoint KV); None unless both have rows, or kinds not told."""
    if meta.generated_rows is None or meta.num_decode_tokens == 0:
        return None
    d = meta.num_decode_tokens
    in_decode = meta.generated_rows.clone()  # [N] bool
    in_decode[d:] = False
    decode_rows = in_decode.nonzero().flatten()
    g = len(decode_rows)
    if g == 0 or g == len(in_decode):
        return None
    rest_rows = (~in_decode).nonzero().flatten()
    rest_decodes = (~in_decode[:d]).nonzero().flatten()  # [d - g]: the decode rows staying in `rest`
    decode = AttentionMetadata(meta.slot_mapping[decode_rows], g, meta.decode_block_tables[decode_rows],
                               meta.decode_context_lens[decode_rows], (), torch.ones(g, dtype=torch.bool))
    rest = AttentionMetadata(meta.slot_mapping[rest_rows], d - g, meta.decode_block_tables[rest_decodes],
                             meta.decode_context_lens[rest_decodes],
                             tuple(replace(p, query_start=p.query_start - g) for p in meta.prefills),
                             meta.generated_rows[rest_rows])
    return RowSplit(decode_rows, decode, rest_rows, rest)


@dataclass(frozen=True, slots=True)
class OutputRows:
    """The rows of a step whose final hidden states are used (those that sample), when they leave work
    out of the last layer: every decode row, and of each prefill chunk its last `tails[i]` rows (a
    chunk's last token, or a speculative chunk's last 1 + drafts). The last layer writes every row's
    K/V but computes its attention output, o projection and MLP for these rows only (llama.cpp's
    `inp_out_ids`): a 512-token prefill step of 200-token prompts samples 2-3 rows."""

    rows: torch.Tensor  # [R] int64, ascending: the kept rows of the step
    tails: tuple[int, ...]  # per prefill chunk, in order: how many of its last rows are kept

    @classmethod
    def of(cls, meta: AttentionMetadata, rows: torch.Tensor) -> OutputRows | None:
        """`rows` [R] (ascending) as kept rows of `meta`'s step; None where keeping them saves nothing
        (every row is kept) or they are not every decode row plus a tail of each chunk."""
        n = meta.num_decode_tokens + sum(p.query_len for p in meta.prefills)
        listed = rows.tolist()
        kept = set(listed)
        if listed != sorted(kept) or len(kept) >= n or not all(r in kept for r in range(meta.num_decode_tokens)):
            return None
        tails = []
        for p in meta.prefills:
            inside = [r for r in range(p.query_start, p.query_start + p.query_len) if r in kept]
            if inside and inside[0] != p.query_start + p.query_len - len(inside):
                return None  # not a tail of the chunk (rows in between left out)
            tails.append(len(inside))
        starts = [p.query_start for p in meta.prefills]
        if starts != sorted(starts) or meta.num_decode_tokens + sum(tails) != len(listed):
            return None  # chunks out of order, or rows outside the step
        return cls(rows, tuple(tails))
