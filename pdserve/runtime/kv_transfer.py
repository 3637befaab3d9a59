"""Copying KV blocks out of an engine's paged cache, and into it as cached blocks.

A prompt of n tokens has ceil(n / block_size) blocks: the full ones, named by their chained
content hash and shareable, and a partial tail named by the hash of its own tokens
(`KVFormat.prompt_hashes`). Each block travels as one tensor `[layers, 2, rows, KVH, D]`.

Out: `export_prompt_blocks` (a held prefill's prompt, for the kvstore), `export_cached_blocks`
(full blocks the cache still holds: write-back of a decoding sequence). In: `place_cached_blocks`
(a prefetch: blocks become cached, unreferenced, shareable by later requests). KV that a request
brings with it does not come in here: it travels on its Sequence and the scheduler takes it in
at admission (`BlockManager.allocate`). All of these run on the engine thread.

Block hashes include the KV format (--kv-dtype), so blocks made in another format never match
this engine's hashes; `Engine.add` tells that case apart from the others (another model or
block size: recompute) and refuses it with `KVFormatError`: a deployment whose prefill and decode
workers disagree on the format would otherwise recompute every prompt, silently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.runtime.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.runtime.engine import Engine


class KVFormatError(ValueError):
    """Blocks made with another --kv-dtype than this engine's; the message names both."""


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    hash: bytes
    data: torch.Tensor  # [layers, 2, rows, KVH, D], a copy
    num_tokens: int  # valid token slots (block_size except for the partial tail)


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for one block, on the calling thread alone where both are contiguous blocks
    of one dtype in host memory. Why not `dst.copy_(src)` there: torch splits a copy of a block's
    size (368 KB for SmolLM2 in bf16) over the engine thread's OpenMP team, whose other member shares
    its core with the host's other processes, so each copy also waits for it. Through the stack at
    32 streams a decode worker's exports took 0.6 ms of its engine thread's CPU a block that way
    against 0.17 now (0.30 -> 0.09 s a run), and the steps wait while it exports."""
    if not (_host_block(dst) and _host_block(src) and dst.dtype == src.dtype and dst.shape == src.shape):
        dst.copy_(src)  # a device's cache, a conversion, a parallel engine's block (kv_shard.CanonicalBlock)
        return
    # Bytes, so that every KV dtype (bf16, fp8) has a numpy view; numpy copies on this thread.
    dst.view(torch.uint8).numpy()[...] = src.view(torch.uint8).numpy()


def clone_block(src: torch.Tensor) -> torch.Tensor:
    """A copy of one block, made as `copy_block` does where it can."""
    if not _host_block(src):
        return src.clone()
    out = torch.empty_like(src)
    copy_block(out, src)
    return out


def _host_block(block: object) -> bool:
    """Whether `block` is a contiguous tensor in host memory (not a device's, nor a parallel
    engine's `kv_shard.CanonicalBlock`, which gathers or scatters across ranks)."""
    return isinstance(block, torch.Tensor) and block.device.type == "cpu" and block.is_contiguous()


def export_prompt_blocks(engine: Engine, seq: Sequence, skip: Collection[bytes] = ()) -> list[ExportedBlock]:
    """Copies of `seq`'s prompt blocks, in order, except those whose hash is in `skip` (stored
    elsewhere already: copying a long conversation's history on every turn costs real time)."""
    fmt = engine.kv_format
    n, bs = len(seq.prompt_ids), fmt.block_size
    return [_prompt_block(engine, seq.block_table[i], h, min(bs, n - i * bs))
            for i, h in enumerate(fmt.prompt_hashes(seq.prompt_ids)) if h not in skip]


def _prompt_block(engine: Engine, block_id: int, hash_: bytes, valid: int) -> ExportedBlock:
    """A copy of the block, its token rows past `valid` zeroed: a partial tail's block may have held
    another sequence's tokens there (a freed block is taken again), which must not leave this engine
    under this prompt's hash. A scaled format's scale row (after the token rows) is kept."""
    data = clone_block(engine.kv_cache[block_id])  # [layers, 2, rows, KVH, D]
    if valid < engine.kv_format.block_size:
        data[:, :, valid:engine.kv_format.block_size] = 0
    return ExportedBlock(hash_, data, valid)


def place_cached_blocks(engine: Engine, hashes: list[bytes], blocks: Mapping[bytes, torch.Tensor],
                        max_blocks: int | None = None) -> list[bytes]:
    """Copies the full blocks `hashes` (a chain, in order) into the paged cache as cached,
    unreferenced blocks that later requests share; stops at the first one missing from both
    the cache and `blocks`. Uses at most `max_blocks` new blocks (default: half of the free
    ones, so a prefetch never crowds out running sequences). Returns the hashes copied in."""
    bm = engine.block_manager
    budget = bm.num_free_blocks // 2 if max_blocks is None else max_blocks
    placed: list[bytes] = []
    for h in hashes:
        if bm.lookup(h) is not None:
            continue
        data = blocks.get(h)
        taken = bm.take_blocks(1) if data is not None and len(placed) < budget else None
        if taken is None:
            break
        bid = taken[0]
        copy_block(engine.kv_cache[bid], data)
        bm.register(bid, h)
        bm.release([bid])  # unreferenced and hashed: cached, evictable in LRU order
        placed.append(h)
    return placed


def export_cached_blocks(engine: Engine, hashes: list[bytes]) -> list[ExportedBlock]:
    """Copies of the full blocks among `hashes` that the paged cache still holds, in order."""
    bm = engine.block_manager
    out = []
    for h in hashes:
        bid = bm.lookup(h)
        if bid is not None:
            out.append(ExportedBlock(h, clone_block(engine.kv_cache[bid]), bm.block_size))
    return out
