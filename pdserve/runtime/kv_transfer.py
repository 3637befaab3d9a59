"""Moving a prompt's KV blocks out of one engine (prefill role) and into another (decode role).

A prompt of n tokens has ceil(n / block_size) blocks: the full ones, named by their chained
content hash and shareable, and a partial tail named by the hash of its own tokens. Each
block travels as one tensor `[layers, 2, block_size, KVH, D]`.

Besides whole prompts: `import_prefix_blocks` starts a new sequence on a prefix of stored blocks
(cross-worker prefix caching: only the rest is computed), `import_cached_blocks` places blocks in
the paged cache as reusable cached blocks (prefetch ahead of a request), `PinnedBlocks` holds
cached blocks for a request until it is added, `export_cached_blocks` reads cached blocks back
out (write-back of a finished sequence), `resident_hashes` lists what the paged cache holds
(reported to the kvstore for KV-aware routing).

Block hashes include the KV format (--kv-dtype), so blocks made in another format never match
this engine's hashes. `import_prompt_blocks` tells that case apart from the others (another
model or block size: recompute) and refuses it with `KVFormatError`: a deployment whose prefill
and decode workers disagree on the format would otherwise recompute every prompt, silently.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.kv_cache import KV_DTYPES
from pdserve.runtime.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.runtime.engine import Engine


class KVFormatError(ValueError):
    """Blocks made with another --kv-dtype than this engine's; the message names both."""


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    hash: bytes
    data: torch.Tensor  # [layers, 2, block_size, KVH, D], a copy
    num_tokens: int  # valid token slots (block_size except for the partial tail)


def prompt_hashes(engine: Engine, prompt_ids: list[int]) -> list[bytes]:
    """Hashes of every prompt block, the partial tail last."""
    bm = engine.block_manager
    return prompt_block_hashes(prompt_ids, bm.block_size, bm.fingerprint, bm.kv_dtype, include_partial=True)


def export_prompt_blocks(engine: Engine, seq: Sequence, skip: Collection[bytes] = ()) -> list[ExportedBlock]:
    """Copies of `seq`'s prompt blocks, in order, except those whose hash is in `skip` (stored
    elsewhere already: copying a long conversation's history on every turn costs real time)."""
    n, bs = len(seq.prompt_ids), engine.block_manager.block_size
    hashes = prompt_hashes(engine, seq.prompt_ids)
    return [ExportedBlock(h, engine.kv_cache[seq.block_table[i]].clone(), min(bs, n - i * bs))
            for i, h in enumerate(hashes) if h not in skip]


def import_prompt_blocks(engine: Engine, seq: Sequence, hashes: list[bytes],
                         blocks: Mapping[bytes, torch.Tensor]) -> bool:
    """Fills `seq`'s block table with its prompt KV; False (nothing held) when any is missing."""
    bm = engine.block_manager
    if hashes != prompt_hashes(engine, seq.prompt_ids):
        check_same_format(engine, seq.prompt_ids, hashes)
        return False  # another model or block size: recompute rather than trust it
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


def check_same_format(engine: Engine, prompt_ids: list[int], hashes: list[bytes]) -> None:
    """Raises KVFormatError when `hashes` are the prompt's block hashes in another KV format."""
    bm = engine.block_manager
    for name in KV_DTYPES:
        if name != bm.kv_dtype and hashes == prompt_block_hashes(
                prompt_ids, bm.block_size, bm.fingerprint, name, include_partial=True):
            raise KVFormatError(f"KV blocks were made with --kv-dtype {name} but this worker runs --kv-dtype "
                                f"{bm.kv_dtype}: prefill and decode workers must use the same --kv-dtype")


def import_prefix_blocks(engine: Engine, seq: Sequence, blocks: Mapping[bytes, torch.Tensor]) -> int:
    """Gives a new `seq` the KV of its longest prefix of full blocks found in this engine's cache
    or in `blocks`; returns how many blocks it got (0: left to the scheduler's own allocation).

    The block holding the prompt's last token is never imported: its logits pick the first
    token, so it is always computed. The imported tokens count as computed and cached.
    """
    bm = engine.block_manager
    limit = (len(seq.prompt_ids) - 1) // bm.block_size
    hashes = prompt_hashes(engine, seq.prompt_ids)[:limit]
    table: list[int] = []
    for h in hashes:
        bid = bm.ref_cached(h)
        if bid is None:
            bid = _copy_in(engine, blocks.get(h))
            if bid is None:
                break  # a gap, or no room: compute from here on
            bm.register(bid, h)
        table.append(bid)
    if table:
        seq.block_table = table
        seq.block_hashes = hashes[:len(table)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(table) * bm.block_size
    return len(table)


def pin_cached_blocks(engine: Engine, hashes: list[bytes]) -> list[int]:
    """Takes a reference on each of `hashes` the paged cache holds, so that no eviction takes it
    before the request that will reuse it is added; release with `block_manager.release`."""
    bm = engine.block_manager
    return [bid for bid in (bm.ref_cached(h) for h in hashes) if bid is not None]


class PinnedBlocks:
    """References on cached blocks (`pin_cached_blocks`) held for a request that is not added yet,
    with one owner that drops them exactly once: by the `add` that hands them to the sequence, or
    by the request's cleanup when it fails or is cancelled first. Every method runs on the engine
    thread, so whichever of the two comes second finds them released and does nothing, whatever
    await a cancellation lands on."""

    __slots__ = ("hashes", "block_ids", "released")

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = list(hashes)
        self.block_ids: list[int] = []
        self.released = False

    def pin(self, engine: Engine) -> None:
        if self.block_ids or self.released:
            raise RuntimeError("PinnedBlocks.pin called twice, or after release")
        self.block_ids = pin_cached_blocks(engine, self.hashes)

    def release(self, engine: Engine) -> None:
        """Drops the references, once (later calls do nothing)."""
        if self.released:
            return
        self.released = True
        ids, self.block_ids = self.block_ids, []
        engine.block_manager.release(ids)


def import_cached_blocks(engine: Engine, hashes: list[bytes], blocks: Mapping[bytes, torch.Tensor],
                         max_blocks: int | None = None) -> int:
    """Copies the full blocks `hashes` (a chain, in order) into the paged cache as cached,
    unreferenced blocks that later requests share; stops at the first one missing from both
    the cache and `blocks`. Uses at most `max_blocks` new blocks (default: half of the free
    ones, so a prefetch never crowds out running sequences). Returns blocks copied in."""
    bm = engine.block_manager
    budget = bm.num_free_blocks // 2 if max_blocks is None else max_blocks
    copied = 0
    for h in hashes:
        if bm.lookup(h) is not None:
            continue
        if copied >= budget:
            break
        bid = _copy_in(engine, blocks.get(h))
        if bid is None:
            break
        bm.register(bid, h)
        bm.release([bid])  # unreferenced and hashed: cached, evictable in LRU order
        copied += 1
    return copied


def export_cached_blocks(engine: Engine, hashes: list[bytes]) -> list[ExportedBlock]:
    """Copies of the full blocks among `hashes` that the paged cache still holds, in order."""
    bm = engine.block_manager
    out = []
    for h in hashes:
        bid = bm.lookup(h)
        if bid is not None:
            out.append(ExportedBlock(h, engine.kv_cache[bid].clone(), bm.block_size))
    return out


def resident_hashes(engine: Engine) -> set[bytes]:
    """Hashes of every full block the paged cache holds (referenced or cached)."""
    return engine.block_manager.resident_hashes()


def _copy_in(engine: Engine, data: torch.Tensor | None) -> int | None:
    if data is None:
        return None
    taken = engine.block_manager.take_blocks(1)
    if taken is None:
        return None
    engine.kv_cache[taken[0]].copy_(data)
    return taken[0]
