"""Dense weights in oneDNN's blocked layout, and oneDNN's linear on them (CPU).

Why: F.linear re-lays a plain bf16 / fp16 weight out for oneDNN on every call (SmolLM2's 57 MB head
at 32 rows: 2.51 against 1.55 ms at two threads); laid out once at load, the call gives F.linear's
bits without that work. oneDNN's fp32 linear is also the row-invariant GEMM of int4_cpu's prompt rows.
"""

from __future__ import annotations

import functools

import torch

PACKED_FOR_ROWS = 32  # the row count oneDNN lays the weight out for (any count runs on it)
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] bf16 / fp16 in oneDNN's blocked layout for `linear_packed` (an opaque tensor),
    or None where torch has no oneDNN, the dtype is another, or the CPU has no oneDNN path for it
    (oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AVX2 CPU raises there)."""
    if not (_can_lay_out(weight) and weight.dtype in (torch.bfloat16, torch.float16) and _onednn_runs(weight.dtype)):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)


def onednn_packed_f32(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] fp32 in oneDNN's blocked layout, for `linear_packed` on two rows or more, or None
    where torch has no oneDNN or this CPU's oneDNN would not give the plain weight's bits on it.

    Why: int4_cpu's fp32 prompt rows run oneDNN's linear on the plain weight, which oneDNN re-lays out
    on every call: SmolLM2's four projections at 22 rows and two threads (AVX2 EPYC) 1.81 -> 1.40 ms a
    layer, at 200 rows 10.7 -> 9.96 ms. One row takes another kernel (other bits): callers pad to more."""
    if not (_can_lay_out(weight) and weight.dtype == torch.float32 and _f32_packed_same_bits()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)


def _can_lay_out(weight: torch.Tensor) -> bool:
    """Whether torch has oneDNN's linear and its weight re-layout, and `weight` is on the CPU."""
    return ONEDNN_LINEAR and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and weight.device.type == "cpu"


@functools.cache
def _f32_packed_same_bits() -> bool:
    """Whether oneDNN's fp32 linear gives the same bits on a packed weight as on the plain one (asked
    once, on a small weight at row counts below, at and above the packing's; measured equal for
    SmolLM2's shapes from 2 to 600 rows on one thread and two, but oneDNN picks kernels by CPU)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1536, generator=gen)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS)
        for rows in (2, 16, 33, 130):
            x = torch.randn(rows, 1536, generator=gen)
            if not torch.equal(linear_packed(x, weight, None), linear_packed(x, packed, None)):
                return False
    except RuntimeError:
        return False
    return True


@functools.cache
def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out and multiplies `dtype` weights on this CPU (asked once, on a tiny weight)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=dtype), PACKED_FOR_ROWS)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ W^T (+ bias) by oneDNN's linear, for W packed by `onednn_packed` (F.linear(x, W,
    bias)'s bits) or a plain W (fp32 too: `_dense_row_invariant`)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
