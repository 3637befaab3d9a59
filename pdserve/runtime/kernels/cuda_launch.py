"""Compiling, launching and argument checks for the CuPy kernels of `cuda_ops`.

The `.cu` sources are compiled by NVRTC once per process per (dtype, head dim) and cached;
launches go on torch's current stream with raw pointers; the checks turn a wrong device,
dtype, shape, stride or alignment into a ValueError instead of a kernel reading garbage.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import numpy as np
import torch

try:
    import cupy
except Exception as exc:  # ImportError, or a cupy that cannot load its CUDA libraries
    raise ImportError(f"pdserve.runtime.kernels.cuda_launch needs a working cupy: {exc}") from exc

CUDA_DIR = Path(__file__).parent / "cuda"
BASE_OPTIONS: tuple[str, ...] = ("-std=c++17",)
DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DTYPE_DEFINE = {"f32": "-DPDS_ONLY_F32", "f16": "-DPDS_ONLY_F16", "bf16": "-DPDS_ONLY_BF16"}

# Launch constants mirrored from the .cu sources (keep in sync).
DECODE_THREADS = 128  # paged_attention.cu
PF_BM, PF_BN, PF_THREADS, PF_PAD = 32, 16, 128, 4  # prefill_attention.cu
PF_SCAN_THREADS = 1024
DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
MAX_DECODE_PARTITIONS = 12 * 1024  # reduce kernel keeps one float per partition in shared memory


# ---- compilation ------------------------------------------------------------------------------


@functools.cache
def kernel_source(filename: str) -> str:
    """The source of `cuda/<filename>` with `common.cuh` pasted in.

    Inlining (rather than -I) makes the text self-contained, so both our cache and CuPy's
    on-disk cache, which key on the source, notice a change of the shared header.
    """
    text = (CUDA_DIR / filename).read_text()
    common = (CUDA_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return text.replace('#include "common.cuh"', common)


@functools.cache
def _module(source: str, options: tuple[str, ...]) -> "cupy.RawModule":
    """One NVRTC module per (source, options), built on first use (CuPy compiles lazily).

    No --use_fast_math: the few approximate intrinsics (__expf in softmax) are explicit in the
    sources, and the norm/RoPE/SiLU kernels keep IEEE division and expf.
    """
    return cupy.RawModule(code=source, options=options)


def compile_options(dtype_suffix: str | None = None, head_dim: int | None = None) -> tuple[str, ...]:
    """NVRTC options that restrict a module to one dtype and one head dim."""
    opts = list(BASE_OPTIONS)
    if dtype_suffix is not None:
        opts.append(DTYPE_DEFINE[dtype_suffix])
    if head_dim is not None:
        opts.append(f"-DPDS_HEAD_DIM={head_dim}")
    return tuple(opts)


@functools.cache
def _kernel(filename: str, name: str, dtype_suffix: str | None = None,
            head_dim: int | None = None) -> "cupy.RawKernel":
    """The kernel `name` of `filename`, built for one dtype / head dim (cached)."""
    return _module(kernel_source(filename), compile_options(dtype_suffix, head_dim)).get_function(name)


# ---- launching ----------------------------------------------------------------------------------


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _i32(x: int) -> np.int32:
    if not -(2**31) <= x < 2**31:
        raise ValueError(f"{x} does not fit a 32-bit kernel argument")
    return np.int32(x)


def _i64(x: int) -> np.int64:
    return np.int64(x)


def _f32(x: float) -> np.float32:
    return np.float32(x)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=64)
def _cupy_stream(device_index: int, stream_ptr: int) -> "cupy.cuda.BaseStream":
    """A CuPy view of the torch stream `stream_ptr` (one object per stream, reused).

    ExternalStream takes the raw pointer on every CuPy from 13.6 on; 14 deprecates it in
    favour of Stream.from_external, which 13.x lacks, so the warning is silenced here.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return cupy.cuda.ExternalStream(stream_ptr, device_index)


_SMEM_OPT_IN: set[tuple[int, int, int]] = set()


def _launch(kernel: "cupy.RawKernel", grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
            device: torch.device, shared_mem: int = 0) -> None:
    """Launches `kernel` on torch's current stream of `device` (also under graph capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        key = (index, id(kernel), shared_mem)
        if shared_mem > DEFAULT_SMEM_LIMIT and key not in _SMEM_OPT_IN:
            kernel.max_dynamic_shared_size_bytes = shared_mem  # opt in beyond 48 KiB
            _SMEM_OPT_IN.add(key)
        with _cupy_stream(index, torch.cuda.current_stream(index).cuda_stream):
            kernel(grid, block, args, shared_mem=shared_mem)


# ---- checks -------------------------------------------------------------------------------------


def _check_cuda(t: torch.Tensor, name: str, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a CUDA tensor, got {where}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _float_suffix(t: torch.Tensor, name: str) -> str:
    if t.dtype not in DTYPE_SUFFIX:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    return DTYPE_SUFFIX[t.dtype]


def _check_same_dtype(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} (no implicit casts)")


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())}")


def _check_aligned(t: torch.Tensor, name: str, alignment: int = 16) -> None:
    if t.data_ptr() % alignment:
        raise ValueError(f"{name} must start at a {alignment}-byte aligned address (vector loads)")


def _check_index(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    """Index tensors (block tables, lengths, slots, positions): int64, contiguous, on device."""
    _check_cuda(t, name, device)
    if t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _check_contiguous(t, name)


def _row_stride(t: torch.Tensor, name: str) -> int:
    """Row stride (elements) of a tensor whose dims after the first are densely packed.

    [N, ...] views such as q, k, v split out of a fused qkv projection qualify: only the
    first stride may differ from the packed layout.
    """
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expected:
            raise ValueError(f"{name}: all dims after the first must be contiguous, got shape "
                             f"{tuple(t.shape)} with strides {tuple(t.stride())}")
        expected *= size
    return t.stride(0) if t.shape[0] > 1 else expected


def _check_cache(kv_cache: torch.Tensor, layer: int) -> tuple[int, int, int, int, int, int]:
    """Returns (num_blocks, layers, block_size, kv_heads, head_dim, dtype) of a valid cache."""
    _check_cuda(kv_cache, "kv_cache")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache must be [num_blocks, layers, 2, block_size, KVH, D], got {tuple(kv_cache.shape)}")
    _check_contiguous(kv_cache, "kv_cache")
    _check_aligned(kv_cache, "kv_cache")
    nb, layers, _, bs, kvh, d = kv_cache.shape
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} out of range for a cache of {layers} layers")
    return nb, layers, bs, kvh, d, kv_cache.dtype


def _cache_strides(kv_cache: torch.Tensor, layer: int) -> tuple[np.int64, np.int64, np.int64]:
    """(layer offset, block stride, keys->values stride) in elements."""
    s = kv_cache.stride()
    return _i64(layer * s[1]), _i64(s[0]), _i64(s[2])


def kernel_head_dim(d: int) -> bool:
    """Whether the attention kernels take head dim d: a warp's 32 lanes split a K/V row, so a
    positive multiple of 32 (every served model's: 64, 128 ...)."""
    return d > 0 and d % 32 == 0


def _check_head_dim(d: int) -> None:
    if not kernel_head_dim(d):
        raise ValueError(f"head dim must be a positive multiple of 32, got {d}")


# ---- norms, RoPE, activation ----------------------------------------------------------------------


def _norm_threads(hidden: int) -> int:
    """Threads per row: up to 16 elements each, a multiple of 32, at most 1024."""
    return min(1024, max(32, 32 * math.ceil(hidden / 16 / 32)))


def _rows(x: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(rows, hidden, row stride) of x viewed as [rows, hidden]."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dim")
    hidden = x.shape[-1]
    if x.dim() == 2:
        return x.shape[0], hidden, _row_stride(x, name)
    _check_contiguous(x, name)
    return x.numel() // max(hidden, 1), hidden, hidden
