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
    if not (ONEDNN_LINEAR and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu"
            and _onednn_runs(weight.dtype)):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)


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
