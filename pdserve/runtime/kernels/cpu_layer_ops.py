"""A decoder layer's fp32 and bf16 row operations in C on the CPU (kernels/cpu/layer_ops.c, built
into cpu_attention's library): RMSNorm with the residual add, RoPE, SiLU-and-multiply, the float KV
write, and greedy sampling's argmax of a step's logits.

torch spends more on dispatching these than on their arithmetic at a few tokens a step (its CPU
RMSNorm alone is six ops); one C call each is a few microseconds. They are also what the one-call
decode step (cpu_decode_step) runs, so the eager step and that step agree to the bit. Each function
returns None where it does not apply (not fp32 / bf16 on the CPU, a layout it does not take, no library):
the caller runs torch's path, the reference (torch_ops). bf16 rows are rounded where torch's path
rounds them (RoPE: the same bits; RMSNorm: at most one bf16 ulp apart, rarely): a bf16 decode step of
one sequence spent about 2 of its 14 ms in torch's versions of these. bf16 SiLU is C's in steps of
fewer than BF16_Q8_BELOW_ROWS rows (those the one-call step runs without AVX-512), and in every step
on a CPU with AVX512-BF16, where its 16-lane fused pass is faster than torch's SiLU then multiply at
any size (a 2-core Xeon, one thread, SmolLM2's 1536: 42 against 53 us at 32 rows, 415 against 552 at
a 330-token prefill's; 16 200-token prompts prefilled 2.29-2.45 -> 2.09-2.25 s). Torch's vectorized
exp may differ from ours in an fp32 last bit, so the eager step takes ours wherever the one-call step
could. Without AVX512-BF16 torch's keeps the steps of many rows, as before (not measured again: an
earlier figure had it the faster, 37 against 65 us at 32 rows).
"""

from __future__ import annotations

import torch

from pdserve.runtime.kernels import cpu_attention
from pdserve.runtime.kernels.cpu_int4_matmul import BF16_Q8_BELOW_ROWS, bf16_available

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _c_rows(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """A CPU tensor of `dtype` whose rows are contiguous, outside autograd (C has no backward:
    training, such as QAT's, takes torch's path)."""
    return (x.dtype == dtype and x.device.type == "cpu" and x.stride(-1) == 1
            and not (x.requires_grad and torch.is_grad_enabled()))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x, residual: [N, D] -> (rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x)
    * weight, x). None where it does not apply."""
    lib, dt = cpu_attention.library(), x.dtype
    if lib is None or x.dim() != 2 or dt not in _SUFFIX or not _c_rows(x, dt) or not _c_rows(weight, dt) or (
            residual is not None and not (_c_rows(residual, dt) and residual.is_contiguous()
                                          and residual.shape == x.shape)):
        return None
    n, d = x.shape
    out = torch.empty((n, d), dtype=dt)
    summed = x if residual is None else torch.empty((n, d), dtype=dt)
    getattr(lib, f"add_rms_norm_{_SUFFIX[dt]}")(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), weight.contiguous().data_ptr(),
        n, d, eps, out.data_ptr(), None if residual is None else summed.data_ptr())
    return out, summed


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x: [N, H, D] with each row's heads contiguous (a view of the fused qkv output) -> rotated [N, H, D]
    contiguous; positions [N] int64; cos, sin [P, D] contiguous. None where it does not apply (a position
    outside [0, P) included)."""
    n, h, d = x.shape
    lib, dt = cpu_attention.library(), x.dtype
    if (lib is None or dt not in _SUFFIX or not _c_rows(x, dt) or x.stride(1) != d or positions.dtype != torch.int64
            or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
            or not positions.is_contiguous()):
        return None
    out = torch.empty((n, h, d), dtype=dt)
    failed = getattr(lib, f"rope_{_SUFFIX[dt]}")(x.data_ptr(), x.stride(0), n, h, d, positions.data_ptr(), cos.data_ptr(),
                          sin.data_ptr(), cos.shape[0], out.data_ptr())
    return None if failed else out  # a position past the tables: torch's path raises the IndexError


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up: [N, 2 I] (gate first) -> silu(gate) * up [N, I]. None where it does not apply."""
    lib, dt = cpu_attention.library(), gate_up.dtype
    rows = gate_up.shape[0]
    c_bf16 = dt == torch.bfloat16 and (rows < BF16_Q8_BELOW_ROWS or bf16_available())
    if lib is None or gate_up.dim() != 2 or not (dt == torch.float32 or c_bf16) or not _c_rows(gate_up, dt):
        return None
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=dt)
    getattr(lib, f"silu_mul_{_SUFFIX[dt]}")(gate_up.data_ptr(), gate_up.stride(0), n, inter, out.data_ptr())
    return out


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """k, v: [N, KVH, D] (each row's heads contiguous) into their slots of a float cache of their own dtype
    ([num_blocks, layers, 2, block_size, KVH, D], contiguous); a negative slot is padding, skipped. False
    where it does not apply; IndexError, nothing written, for a slot past the cache."""
    if (kv_cache.device.type != "cpu" or not kv_cache.is_contiguous() or k.dtype != kv_cache.dtype
            or v.dtype != kv_cache.dtype or kv_cache.dtype not in (torch.float32, torch.bfloat16)
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or cpu_attention.library() is None):
        return False
    _, layers, _, block_size, kvh, d = kv_cache.shape
    if any(t.stride(2) != 1 or t.stride(1) != d for t in (k, v)):
        return False
    es = kv_cache.element_size()
    row = kvh * d * es
    if cpu_attention.library().kv_write_rows(kv_cache.data_ptr(), k.data_ptr(), k.stride(0) * es, v.data_ptr(),
                                             v.stride(0) * es, slot_mapping.data_ptr(), k.shape[0], row, block_size,
                                             layers * 2 * block_size * row, layer * 2 * block_size * row,
                                             kv_cache.shape[0] * block_size):
        raise IndexError(f"a KV slot past the cache ({kv_cache.shape[0]} blocks of {block_size} tokens)")
    return True


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """logits: [N, V] fp32 -> each row's `max(dim=-1).indices` (the first maximal value, the first NaN
    where a row has one). torch's CPU max-with-indices is a scalar loop (SmolLM2's 49,152 logits at 28
    rows: 1.1 ms a step); this one vectorized. None where it does not apply."""
    if logits.dim() != 2 or not _c_rows(logits) or logits.shape[1] == 0:
        return None  # checked first: a GPU step's logits never build the CPU library
    lib = cpu_attention.library()
    if lib is None:
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out.tolist()
