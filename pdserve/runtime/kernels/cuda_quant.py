"""W8A16 / W4A16 on a GPU: the CuPy kernel of `cuda/quant_matmul.cu` for GPTQ-packed weights.

`quant_matmul` multiplies a few activation rows (decode: one per sequence, up to MAX_ROWS) by a
packed weight without materialising it; more rows (prefill) are left to the caller, which
dequantizes once and runs a GEMM. Importing this module raises ImportError when cupy is unusable,
and `QuantLinear` then stays on its torch path. Reference: `QuantLinear.weight_t` + matmul.
"""

from __future__ import annotations

import math

import torch

from pdserve.runtime.kernels.cuda_launch import (
    _check_contiguous,
    _check_cuda,
    _float_suffix,
    _i32,
    _i64,
    _kernel,
    _launch,
    _ptr,
    _sm_count,
)

MAX_ROWS = 8
THREADS, KTILE = 128, 256  # quant_matmul.cu's QMM_THREADS, QMM_KTILE (keep in sync)
_ROW_VARIANTS = (1, 2, 4, 8)


def split_k(in_features: int, out_features: int, sm_count: int) -> tuple[int, int]:
    """(splits, input channels per split): enough thread blocks for about two per SM."""
    tiles = math.ceil(in_features / KTILE)
    col_blocks = math.ceil(out_features / THREADS)
    splits = max(1, min(tiles, math.ceil(2 * sm_count / col_blocks)))
    per = math.ceil(tiles / splits) * KTILE
    return math.ceil(in_features / per), per


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """x [N, K] (N <= MAX_ROWS) -> [N, O] in x's dtype; scales/zeros fp32 [G, O], g_idx int32 [K]."""
    _check_cuda(x, "x")
    suffix = _float_suffix(x, "x")
    dev = x.device
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, K] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    n, k = x.shape
    if not 0 < n <= MAX_ROWS:
        raise ValueError(f"quant_matmul takes 1..{MAX_ROWS} rows, got {n}: dequantize and use a GEMM")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    per_word = 32 // bits
    o = qweight.shape[1]
    for t, name, dtype, shape in ((qweight, "qweight", torch.int32, (math.ceil(k / per_word), o)),
                                  (scales, "scales", torch.float32, (scales.shape[0], o)),
                                  (zeros, "zeros", torch.float32, tuple(scales.shape)),
                                  (g_idx, "g_idx", torch.int32, (k,))):
        _check_cuda(t, name, dev)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        _check_contiguous(t, name)
    rows = next(r for r in _ROW_VARIANTS if r >= n)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    splits, per = split_k(k, o, _sm_count(index))
    partial = torch.empty((splits, n, o), dtype=torch.float32, device=dev)
    kernel = _kernel("quant_matmul.cu", f"quant_matmul_{suffix}_w{bits}_r{rows}", suffix)
    args = (_ptr(partial), _ptr(x), _ptr(qweight), _ptr(scales), _ptr(zeros), _ptr(g_idx),
            _i64(x.stride(0)), _i32(n), _i32(k), _i32(o), _i32(per))
    _launch(kernel, (math.ceil(o / THREADS), splits), (THREADS,), args, dev)
    return (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)
