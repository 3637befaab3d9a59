"""Torch implementations of the runtime's kernels: the CPU path and the reference for CUDA.

The paged KV cache `kv_cache` is `[num_blocks, layers, 2, block_size, KVH, D]` (0 = keys,
1 = values), so one block of one sequence is one contiguous slab across all layers. A scaled
cache (int8 / fp8 codes plus a scale row per block, see `pdserve.runtime.kv_cache`) is written
and read through `kv_quant`; float caches take the direct path below, unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.runtime.kernels import cpu_attention, cpu_kv_write, cpu_layer_ops, kv_quant
from pdserve.runtime.kernels.step_memo import per_step
from pdserve.runtime.kv_cache import block_size_of, is_scaled

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, hidden] -> [N, hidden]; fp32 on the CPU in C (cpu_layer_ops), else `rms_norm_torch`."""
    done = cpu_layer_ops.add_rms_norm(x, None, weight, eps)
    return rms_norm_torch(x, weight, eps) if done is None else done[0]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: one fused op (fp32 math as transformers does: normalized in fp32, rounded to x's
    dtype, then scaled by the weight in that dtype)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual)."""
    done = cpu_layer_ops.add_rms_norm(x, residual, weight, eps)
    if done is not None:
        return done
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


def rope_cos_sin(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables of the rotate-half RoPE convention: cos, sin each [max_positions, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, H, D], k: [N, KVH, D], positions: [N] -> rotated (q, k); fp32 on the CPU in C."""
    q_rot, k_rot = cpu_layer_ops.rope(q, positions, cos, sin), cpu_layer_ops.rope(k, positions, cos, sin)
    if q_rot is not None and k_rot is not None:
        return q_rot, k_rot
    return apply_rope_torch(q, k, positions, cos, sin)


def apply_rope_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: q * cos + rotate_half(q) * sin, the same for k."""
    c, s = per_step("rope", (positions, cos, sin, q.dtype), lambda: (
        cos[positions].unsqueeze(1).to(q.dtype), sin[positions].unsqueeze(1).to(q.dtype)))  # [N, 1, D] each
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * I] (gate first) -> silu(gate) * up: [N, I]; fp32 on the CPU in C."""
    done = cpu_layer_ops.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up) if done is None else done


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The reference."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(
    kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters k, v: [N, KVH, D] into their slots (slot = block_id * block_size + offset). A scaled cache
    is quantized: INT8 on the CPU by the C write (kernels.cpu_kv_write) where it applies, else kv_quant's;
    a float one is copied into, in C on the CPU (cpu_layer_ops) where the dtypes match."""
    if is_scaled(kv_cache.dtype):
        if not cpu_kv_write.write_kv(kv_cache, layer, k, v, slot_mapping):
            kv_quant.write_kv(kv_cache, layer, k, v, slot_mapping)
        return
    if cpu_layer_ops.write_kv(kv_cache, layer, k, v, slot_mapping):
        return
    block_size = kv_cache.shape[3]
    block_ids, offsets = per_step("slots", (slot_mapping, block_size), lambda: (
        torch.div(slot_mapping, block_size, rounding_mode="floor"), slot_mapping % block_size))
    kv_cache[block_ids, layer, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[block_ids, layer, 1, offsets] = v.to(kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table: [..., MB] -> keys, values: [..., MB * block_size, KVH, D] (contiguous copies).

    index_select over a [num_blocks, layers * 2, slab] view is several times faster on the
    CPU than advanced indexing of the 6-d cache. A scaled cache comes back dequantized (fp32).
    """
    nb, layers, _, rows, kvh, d = kv_cache.shape
    scaled = is_scaled(kv_cache.dtype)
    slabs = (kv_cache.view(torch.uint8) if scaled else kv_cache).view(nb, layers * 2, rows * kvh * d)
    flat = block_table.reshape(-1)
    k = slabs[:, 2 * layer].index_select(0, flat)
    v = slabs[:, 2 * layer + 1].index_select(0, flat)
    if scaled:  # bytes gathered (see kv_quant), dequantized here
        k = kv_quant.dequantize_slabs(k.view(kv_cache.dtype).view(-1, rows, kvh, d))
        v = kv_quant.dequantize_slabs(v.view(kv_cache.dtype).view(-1, rows, kvh, d))
    shape = (*block_table.shape[:-1], block_table.shape[-1] * block_size_of(kv_cache), kvh, d)
    return k.view(shape), v.view(shape)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its paged context: the cache read in place by the C kernel
    (kernels.cpu_attention) where it applies, else `paged_decode_attention_torch`.

    q: [B, H, D]; block_tables: [B, MB] (padded); context_lens: [B] -> out [B, H, D].
    """
    out = cpu_attention.paged_decode_attention(q, kv_cache, layer, block_tables, context_lens, scale)
    if out is None:
        out = paged_decode_attention_torch(q, kv_cache, layer, block_tables, context_lens, scale)
    return out


def paged_decode_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: each sequence's blocks gathered (padded to the longest), then SDPA. Shapes as above."""
    b, h, d = q.shape
    kvh = kv_cache.shape[4]
    k, v = _gather_kv(kv_cache, layer, block_tables)  # [B, T, KVH, D]
    t = k.shape[1]
    bias = per_step("decode_mask", (context_lens, t, q.dtype), lambda: _decode_bias(context_lens, t, q.dtype))
    # The H / KVH query heads sharing a kv head are SDPA's "query length": no KV expansion.
    out = F.scaled_dot_product_attention(
        q.view(b, kvh, h // kvh, d),  # [B, KVH, G, D]
        k.transpose(1, 2).to(q.dtype),  # [B, KVH, T, D]
        v.transpose(1, 2).to(q.dtype),
        attn_mask=bias, scale=scale)
    return out.reshape(b, h, d)


def _decode_bias(context_lens: torch.Tensor, t: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, T]: 0 over each sequence's context, -inf over the padding after it."""
    invalid = torch.arange(t, device=context_lens.device)[None, :] >= context_lens[:, None]  # [B, T]
    return torch.zeros(len(context_lens), 1, 1, t, dtype=dtype, device=context_lens.device).masked_fill_(
        invalid[:, None, None, :], float("-inf"))


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix plus themselves: the cache
    read in place by the C kernel (kernels.cpu_attention) where it applies, else `prefill_attention_torch`.

    q: [n, H, D] are the last n positions of a context of `context_len` tokens whose keys
    and values are already written into the blocks of `block_table` ([MB]) -> out [n, H, D].
    """
    out = cpu_attention.paged_prefill_attention(q, kv_cache, layer, block_table, context_len, scale)
    return prefill_attention_torch(q, kv_cache, layer, block_table, context_len, scale) if out is None else out


def prefill_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                            context_len: int, scale: float) -> torch.Tensor:
    """The reference: the sequence's blocks gathered, then torch's SDPA. Shapes as above."""
    n = q.shape[0]
    num_blocks = -(-context_len // block_size_of(kv_cache))
    k, v = _gather_kv(kv_cache, layer, block_table[:num_blocks])  # [T', KVH, D]
    k, v = k[:context_len].transpose(0, 1), v[:context_len].transpose(0, 1)  # [KVH, T, D]
    if n == context_len and q.device.type == "cpu":
        # No cached prefix: is_causal needs neither a mask nor repeated KV heads and still takes
        # torch's flash kernel, with the same bits as the masked call below (SmolLM2's 9 / 3
        # heads, bf16, 1 thread: 200 tokens 0.49 -> 0.41 ms a layer, 512 tokens 2.07 -> 1.58).
        # The CPU only: on a GPU (where this is the fallback of scaled caches and head dims the
        # CUDA kernels do not take) the masked call is the one tests/gpu passed with.
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.to(q.dtype)[None], v.to(q.dtype)[None],
                                             is_causal=True, scale=scale, enable_gqa=True)  # [1, H, n, D]
        return out[0].transpose(0, 1)
    mask = per_step("prefill_mask", (block_table, n, context_len, q.dtype),
                     lambda: _causal_bias(n, context_len, q.dtype, q.device))
    # A chunk after a prefix sees its queries' diagonal offset by the prefix, which is_causal
    # (top-left aligned) does not express: KV heads repeated for their query heads and an additive
    # mask, which on the CPU takes torch's flash kernel, 2-2.5x faster than the math path that
    # enable_gqa with a mask selects (a 200-token bf16 prompt, SmolLM2's 9 / 3 heads, 1 thread:
    # 1.6 against 3.9 ms a layer).
    group = q.shape[1] // k.shape[0]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], _repeat_heads(k.to(q.dtype), group)[None],
        _repeat_heads(v.to(q.dtype), group)[None], attn_mask=mask, scale=scale,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1)


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[KVH, T, D] -> [KVH * group, T, D], each kv head repeated for the query heads sharing it."""
    return x if group == 1 else x.repeat_interleave(group, dim=0)


def _causal_bias(n: int, context_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, T]: 0 where the last n positions of a context of T tokens see (themselves and before), -inf after."""
    q_pos = torch.arange(context_len - n, context_len, device=device)[:, None]
    hidden = torch.arange(context_len, device=device)[None, :] > q_pos
    return torch.zeros(n, context_len, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
