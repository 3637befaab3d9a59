"""Writing and reading a scaled (INT8 / FP8-e4m3) paged KV cache in torch: CPU path and GPU fallback.

One fp32 scale per (block, layer, k/v, head) lives in the block's scale row (see
`pdserve.runtime.kv_cache`). A block fills token by token (prefill chunks, then one decode token
per step), so its scale can only grow: when new tokens exceed the range, the block's existing
codes of that head are requantized to the new scale (round(code * old / new)), each time adding
at most half a step of the new scale. A write that starts a block (offset 0) ignores the stale
scale a reused block still carries.

Indexing goes through a uint8 view of the cache: gathers and scatters then only move bytes, which
every device supports for every dtype (torch lacks some float8 index kernels on CUDA).
"""

from __future__ import annotations

import torch

from pdserve.runtime.kv_cache import SCALED_QMAX, block_size_of

_TINY = 2.0 ** -100  # scale of an all-zero head: any positive value decodes zeros as zeros


def scales_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, layers, 2, KVH] fp32, a view into the cache's scale rows (writable)."""
    bs = block_size_of(kv_cache)
    return kv_cache[:, :, :, bs, :, :4].view(torch.float32).squeeze(-1)


def encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values already divided by their scale -> codes of `dtype` (rounded, saturated)."""
    qmax = SCALED_QMAX[dtype]
    if dtype == torch.int8:
        return values.round().clamp_(-qmax, qmax).to(torch.int8)
    return values.clamp(-qmax, qmax).to(dtype)


def quantize_heads(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., T, KVH, D] -> (codes like x, scales [..., KVH]) with one scale per head over T and D."""
    amax = x.float().abs().amax(dim=(-3, -1))
    scale = (amax / SCALED_QMAX[dtype]).clamp_(min=_TINY)
    return encode(x.float() / scale.unsqueeze(-2).unsqueeze(-1), dtype), scale


def dequantize_slabs(slabs: torch.Tensor) -> torch.Tensor:
    """slabs: [..., bs + 1, KVH, D] in a scaled storage dtype -> fp32 values [..., bs, KVH, D]."""
    bs = slabs.shape[-3] - 1
    scale = slabs[..., bs, :, :4].contiguous().view(torch.float32)  # [..., KVH, 1]
    return slabs[..., :bs, :, :].float() * scale.unsqueeze(-3)


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Quantizes k, v: [N, KVH, D] into their slots (slot = block_id * block_size + offset).

    Keys and values go together ([N, 2, KVH, D]); blocks whose scale grew have their earlier codes
    requantized, the others (most decode steps) only get the new rows written.
    """
    bs, kvh = block_size_of(kv_cache), k.shape[1]
    block_ids = torch.div(slot_mapping, bs, rounding_mode="floor")
    offsets = slot_mapping % bs
    blocks, inverse = torch.unique(block_ids, return_inverse=True)
    x = torch.stack((k, v), dim=1).float()  # [N, 2, KVH, D]
    need = torch.zeros(blocks.shape[0], 2, kvh, device=x.device).scatter_reduce_(
        0, inverse[:, None, None].expand(-1, 2, kvh), x.abs().amax(-1), "amax")  # [U, 2, KVH]
    fresh = torch.zeros(blocks.shape[0], dtype=torch.bool, device=x.device)
    fresh[inverse[offsets == 0]] = True
    scales = scales_view(kv_cache)[:, layer]  # [NB, 2, KVH]
    old = scales[blocks].masked_fill_(fresh[:, None, None], 0.0)
    new = torch.maximum(old, need / SCALED_QMAX[kv_cache.dtype]).clamp_(min=_TINY)
    grown = ((new > old) & (old > 0)).flatten(1).any(1)
    raw, dtype = kv_cache.view(torch.uint8), kv_cache.dtype
    if grown.any():
        g = blocks[grown]
        ratio = (old[grown] / new[grown])[:, :, None, :, None]  # [G, 2, 1, KVH, 1]
        codes = raw[g, layer, :, :bs].view(dtype).float() * ratio
        raw[g, layer, :, :bs] = encode(codes, dtype).view(torch.uint8)
    codes = encode(x / new[inverse].unsqueeze(-1), dtype).view(torch.uint8)
    raw[block_ids, layer, 0, offsets] = codes[:, 0]
    raw[block_ids, layer, 1, offsets] = codes[:, 1]
    scales[blocks] = new
