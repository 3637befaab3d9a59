"""Moving a prompt's KV blocks out of one engine (prefill role) and into another (decode role).

A prompt of n tokens has ceil(n / block_size) blocks: the full ones, named by their chained
content hash and shareable, and a partial tail named by the hash of its own tokens. Each
block travels as one tensor `[layers, 2, block_size, KVH, D]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.runtime.engine import Engine


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    hash: bytes
    data: torch.Tensor  # [layers, 2, block_size, KVH, D], a copy
    num_tokens: int  # valid token slots (block_size except for the partial tail)


def prompt_hashes(engine: Engine, prompt_ids: list[int]) -> list[bytes]:
    """Hashes of every prompt block, the partial tail last."""
    bm = engine.block_manager
    return prompt_block_hashes(prompt_ids, bm.block_size, bm.fingerprint, bm.kv_dtype, include_partial=True)


def export_prompt_blocks(engine: Engine, seq: Sequence) -> list[ExportedBlock]:
    n, bs = len(seq.prompt_ids), engine.block_manager.block_size
    hashes = prompt_hashes(engine, seq.prompt_ids)
    return [ExportedBlock(h, engine.kv_cache[seq.block_table[i]].clone(), min(bs, n - i * bs))
            for i, h in enumerate(hashes)]


def import_prompt_blocks(engine: Engine, seq: Sequence, hashes: list[bytes],
                         blocks: Mapping[bytes, torch.Tensor]) -> bool:
    """Fills `seq`'s block table with its prompt KV; False (nothing held) when any is missing."""
    bm = engine.block_manager
    if hashes != prompt_hashes(engine, seq.prompt_ids):
        return False  # another model, dtype or block size: recompute rather than trust it
    num_full = len(seq.prompt_ids) // bm.block_size
    table: list[int] = []
    for i, h in enumerate(hashes):
        bid = bm.ref_cached(h) if i < num_full else None
        if bid is None:
            bid = _copy_in(engine, blocks.get(h))
            if bid is None:
                bm.release(table)
                return False
            if i < num_full:
                bm.register(bid, h)
        table.append(bid)
    seq.block_table = table
    seq.block_hashes = hashes[:num_full]
    seq.num_computed_tokens = len(seq.prompt_ids)
    return True


def _copy_in(engine: Engine, data: torch.Tensor | None) -> int | None:
    if data is None:
        return None
    taken = engine.block_manager.take_blocks(1)
    if taken is None:
        return None
    engine.kv_cache[taken[0]].copy_(data)
    return taken[0]
