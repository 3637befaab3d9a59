"""CUDA implementations of the runtime's kernels: CuPy raw kernels over the sources in `cuda/`.

Same public functions and signatures as `torch_ops` (the reference), plus the packed
`prefill_attention_varlen` (reference: `torch_varlen`). Importing this module raises
ImportError when cupy is unusable, which makes `get_kernels` fall back to torch.

How a call runs: the `.cu` file is compiled by NVRTC once per process for the (dtype, head
dim) it needs (`_module`, cached; CuPy also keeps the binary on disk), the tensors are checked
(device, dtype, shape, strides, alignment: a ValueError says what is wrong instead of a kernel
reading garbage), and the kernel is launched on torch's current stream with raw data
pointers, so nothing is copied and the launch composes with torch's stream order and CUDA
graph capture. No function here synchronises with the host.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import warnings

import numpy as np
import torch

try:
    import cupy
except Exception as exc:  # ImportError, or a cupy that cannot load its CUDA libraries
    raise ImportError(f"pdserve.runtime.kernels.cuda_ops needs a working cupy: {exc}") from exc

from pdserve.runtime.kernels import torch_ops

rope_cos_sin = torch_ops.rope_cos_sin  # host-side tables: same function on every backend

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


def _check_head_dim(d: int) -> None:
    if d % 32 or d <= 0:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [N, hidden] -> [N, hidden]; normalised in fp32 as the reference does."""
    _check_cuda(x, "x")
    suffix = _float_suffix(x, "x")
    _check_cuda(weight, "weight", x.device)
    _check_same_dtype(weight, "weight", x.dtype)
    rows, hidden, stride = _rows(x, "x")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    _check_contiguous(weight, "weight")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or hidden == 0:
        return out
    kernel = _kernel("norm_rope_act.cu", f"rms_norm_{suffix}", suffix)
    args = (_ptr(out), _ptr(x), _ptr(weight), _i64(stride), _i32(hidden), _f32(eps))
    _launch(kernel, (rows,), (_norm_threads(hidden),), args, x.device)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual)."""
    _check_cuda(x, "x")
    suffix = _float_suffix(x, "x")
    _check_cuda(residual, "residual", x.device)
    _check_same_dtype(residual, "residual", x.dtype)
    _check_cuda(weight, "weight", x.device)
    _check_same_dtype(weight, "weight", x.dtype)
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    rows, hidden, x_stride = _rows(x, "x")
    _, _, r_stride = _rows(residual, "residual")
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    _check_contiguous(weight, "weight")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or hidden == 0:
        return out, summed
    kernel = _kernel("norm_rope_act.cu", f"add_rms_norm_{suffix}", suffix)
    args = (_ptr(out), _ptr(summed), _ptr(x), _ptr(residual), _ptr(weight), _i64(x_stride),
            _i64(r_stride), _i32(hidden), _f32(eps))
    _launch(kernel, (rows,), (_norm_threads(hidden),), args, x.device)
    return out, summed


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, H, D], k: [N, KVH, D], positions: [N] -> rotated (q, k), new contiguous tensors.

    q and k may be row-strided views (e.g. split out of a fused qkv); cos, sin are the fp32
    [max_positions, D] tables of `rope_cos_sin`. Positions are not range-checked (that would
    need a host sync): they must be < max_positions.
    """
    _check_cuda(q, "q")
    suffix = _float_suffix(q, "q")
    dev = q.device
    _check_cuda(k, "k", dev)
    _check_same_dtype(k, "k", q.dtype)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [N, H, D] and k [N, KVH, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}")
    n, h, d = q.shape
    kvh = k.shape[1]
    if d % 2:
        raise ValueError(f"head dim must be even for RoPE, got {d}")
    _check_index(positions, "positions", (n,), dev)
    for t, name in ((cos, "cos"), (sin, "sin")):
        _check_cuda(t, name, dev)
        _check_same_dtype(t, name, torch.float32)
        _check_contiguous(t, name)
        if t.dim() != 2 or t.shape[1] != d:
            raise ValueError(f"{name} must be [max_positions, {d}], got {tuple(t.shape)}")
    q_out = torch.empty((n, h, d), dtype=q.dtype, device=dev)
    k_out = torch.empty((n, kvh, d), dtype=k.dtype, device=dev)
    if n == 0:
        return q_out, k_out
    kernel = _kernel("norm_rope_act.cu", f"rope_{suffix}", suffix)
    args = (_ptr(q_out), _ptr(k_out), _ptr(q), _ptr(k), _ptr(positions), _ptr(cos), _ptr(sin),
            _i64(_row_stride(q, "q")), _i64(_row_stride(k, "k")), _i32(h), _i32(kvh), _i32(d))
    threads = min(256, 32 * math.ceil((h + kvh) * d // 2 / 32))
    _launch(kernel, (n,), (threads,), args, dev)
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2 * I] (gate first) -> silu(gate) * up: [N, I]."""
    _check_cuda(gate_up, "gate_up")
    suffix = _float_suffix(gate_up, "gate_up")
    rows, width, stride = _rows(gate_up, "gate_up")
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even, got {width}")
    inter = width // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    kernel = _kernel("norm_rope_act.cu", f"silu_and_mul_{suffix}", suffix)
    threads = 256
    args = (_ptr(out), _ptr(gate_up), _i64(stride), _i32(inter))
    _launch(kernel, (rows, math.ceil(inter / threads)), (threads,), args, gate_up.device)
    return out


# ---- KV cache write -----------------------------------------------------------------------------


def write_kv(
    kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters k, v: [N, KVH, D] into their slots (slot = block_id * block_size + offset).

    k and v must already have the cache's dtype; a negative slot skips its token (padding).
    Slots are not range-checked (that would need a host sync).
    """
    _, _, bs, kvh, d, dtype = _check_cache(kv_cache, layer)
    dev = kv_cache.device
    n = k.shape[0] if k.dim() == 3 else -1
    for t, name in ((k, "k"), (v, "v")):
        _check_cuda(t, name, dev)
        _check_same_dtype(t, name, dtype)
        if tuple(t.shape) != (n, kvh, d):
            raise ValueError(f"{name} must be [N, {kvh}, {d}], got {tuple(t.shape)}")
    _check_index(slot_mapping, "slot_mapping", (n,), dev)
    if n == 0:
        return
    item = kv_cache.element_size()
    if item not in (2, 4):
        raise ValueError(f"write_kv supports 16- and 32-bit caches, got {dtype}")
    kernel = _kernel("cache_ops.cu", f"write_kv_{8 * item}")
    layer_off, block_stride, kv_stride = _cache_strides(kv_cache, layer)
    args = (_ptr(kv_cache), _ptr(k), _ptr(v), _ptr(slot_mapping), _i64(_row_stride(k, "k")),
            _i64(_row_stride(v, "v")), _i32(kvh * d), layer_off, block_stride, kv_stride, _i32(bs))
    _launch(kernel, (n,), (min(256, 32 * math.ceil(kvh * d / 32)),), args, dev)


# ---- attention --------------------------------------------------------------------------------


def _check_attention_q(q: torch.Tensor, kv_cache: torch.Tensor, layer: int) -> tuple[str, int, int, int, int]:
    """Checks q [N, H, D] against the cache; returns (dtype suffix, H, KVH, D, block_size)."""
    _, _, bs, kvh, d, dtype = _check_cache(kv_cache, layer)
    _check_cuda(q, "q", kv_cache.device)
    suffix = _float_suffix(q, "q")
    _check_same_dtype(kv_cache, "kv_cache", q.dtype)
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [N, H, {d}], got {tuple(q.shape)}")
    _check_contiguous(q, "q")
    _check_aligned(q, "q")
    _check_head_dim(d)
    h = q.shape[1]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kvh})")
    return suffix, h, kvh, d, bs


def row_split(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(VEC, TG) of paged_attention.cu's RowSplit: elements per lane, lanes per K/V row."""
    vec16 = 16 // itemsize
    tg = head_dim // vec16
    if head_dim % vec16 == 0 and tg & (tg - 1) == 0 and 0 < tg <= 32:
        return vec16, tg
    return head_dim // 32, 32


def decode_smem_bytes(group: int, head_dim: int, partition: int, itemsize: int) -> int:
    """Dynamic shared memory of the decode kernel: q_s, logits, red, stats (floats)."""
    vec, _ = row_split(head_dim, itemsize)
    return 4 * (group * head_dim + group * partition + DECODE_THREADS * vec + 2 * group)


def decode_partition_size(batch: int, kv_heads: int, max_context: int, group: int, head_dim: int,
                          itemsize: int, sm_count: int) -> int:
    """Tokens per split-K partition, chosen from shapes only (no host sync).

    Starts at 512 and halves (down to 64) while the grid B * KVH * ceil(T / P) would not give
    every SM about two blocks, so that one long sequence still spreads over the whole GPU;
    then halves further only if the logits would not fit the default shared memory.
    """
    p = 512
    while p > 64 and batch * kv_heads * math.ceil(max_context / p) < 2 * sm_count:
        p //= 2
    while p > 32 and decode_smem_bytes(group, head_dim, p, itemsize) > DEFAULT_SMEM_LIMIT:
        p //= 2
    while math.ceil(max_context / p) > MAX_DECODE_PARTITIONS:
        p *= 2
    return p


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged context (split-K over the context).

    q: [B, H, D]; block_tables: [B, MB] (padded); context_lens: [B] -> out [B, H, D].
    The grid is sized from MB * block_size, an upper bound of every context, so no length
    is read back to the host. A context of 0 gives zeros.
    """
    suffix, h, kvh, d, bs = _check_attention_q(q, kv_cache, layer)
    dev = q.device
    b = q.shape[0]
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [B, MB], got {tuple(block_tables.shape)}")
    mb = block_tables.shape[1]
    _check_index(block_tables, "block_tables", (b, mb), dev)
    _check_index(context_lens, "context_lens", (b,), dev)
    out = torch.empty_like(q)
    if b == 0:
        return out
    if mb == 0:
        return out.zero_()
    if b > 65535:
        raise ValueError(f"batch {b} exceeds the grid's z limit (65535)")
    group = h // kvh
    max_context = mb * bs
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    p = decode_partition_size(b, kvh, max_context, group, d, q.element_size(), _sm_count(index))
    num_parts = math.ceil(max_context / p)
    smem = decode_smem_bytes(group, d, p, q.element_size())
    layer_off, block_stride, kv_stride = _cache_strides(kv_cache, layer)
    kernel = _kernel("paged_attention.cu", f"paged_decode_attention_{suffix}_d{d}", suffix, d)
    part_out = part_max = part_sum = None
    if num_parts > 1:
        part_out = torch.empty((b, h, num_parts, d), dtype=torch.float32, device=dev)
        part_max = torch.empty((b, h, num_parts), dtype=torch.float32, device=dev)
        part_sum = torch.empty((b, h, num_parts), dtype=torch.float32, device=dev)
    args = (_ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(q), _ptr(kv_cache),
            _ptr(block_tables), _ptr(context_lens), layer_off, block_stride, kv_stride, _i32(bs),
            _i32(mb), _i32(h), _i32(kvh), _i32(p), _i32(num_parts), _f32(scale))
    _launch(kernel, (num_parts, kvh, b), (DECODE_THREADS,), args, dev, smem)
    if num_parts > 1:
        reduce = _kernel("paged_attention.cu", f"paged_decode_reduce_{suffix}", suffix, d)
        args = (_ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(context_lens),
                _i32(h), _i32(d), _i32(p), _i32(num_parts))
        _launch(reduce, (h, b), (128,), args, dev, 4 * num_parts)
    return out


def prefill_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the prefill kernel: Q, K, V tiles in fp32 with padded rows."""
    return 4 * (PF_BM + 2 * PF_BN) * (head_dim + PF_PAD)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix plus themselves.

    q: [n, H, D] are the last n positions of a context of `context_len` tokens whose keys
    and values are already written into the blocks of `block_table` ([MB]) -> out [n, H, D].
    """
    suffix, h, kvh, d, bs = _check_attention_q(q, kv_cache, layer)
    dev = q.device
    n = q.shape[0]
    if block_table.dim() != 1:
        raise ValueError(f"block_table must be [MB], got {tuple(block_table.shape)}")
    _check_index(block_table, "block_table", (block_table.shape[0],), dev)
    context_len = int(context_len)
    if not n <= context_len <= block_table.shape[0] * bs:
        raise ValueError(f"need n ({n}) <= context_len ({context_len}) <= MB * block_size "
                         f"({block_table.shape[0] * bs})")
    out = torch.empty_like(q)
    if n == 0:
        return out
    if h > 65535:
        raise ValueError(f"{h} heads exceed the grid's y limit (65535)")
    layer_off, block_stride, kv_stride = _cache_strides(kv_cache, layer)
    kernel = _kernel("prefill_attention.cu", f"prefill_attention_{suffix}_d{d}", suffix, d)
    args = (_ptr(out), _ptr(q), _ptr(kv_cache), _ptr(block_table), layer_off, block_stride,
            kv_stride, _i32(n), _i32(context_len), _i32(h), _i32(kvh), _i32(bs), _f32(scale))
    _launch(kernel, (math.ceil(n / PF_BM), h), (PF_THREADS,), args, dev, prefill_smem_bytes(d))
    return out


def prefill_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of several sequences' new tokens, packed in one batch, one launch.

    q: [N, H, D] with sequence s owning rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1];
    context_lens: [S] (cached prefix + new tokens); block_tables: [S, MB] -> out [N, H, D].
    Lengths stay on the device: a tiny scan kernel turns them into per-sequence tile offsets
    and the grid is sized by the bound ceil(N / 32) + S. The lengths are trusted (checking
    them would need a host sync): 0 <= n_s <= context_lens[s] <= MB * block_size.
    """
    suffix, h, kvh, d, bs = _check_attention_q(q, kv_cache, layer)
    dev = q.device
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, MB], got {tuple(block_tables.shape)}")
    s, mb = block_tables.shape
    _check_index(cu_seqlens_q, "cu_seqlens_q", (s + 1,), dev)
    _check_index(context_lens, "context_lens", (s,), dev)
    _check_index(block_tables, "block_tables", (s, mb), dev)
    n = q.shape[0]
    out = torch.empty_like(q)
    if n == 0 or s == 0:
        return out
    if h > 65535:
        raise ValueError(f"{h} heads exceed the grid's y limit (65535)")
    tile_offsets = torch.empty(s + 1, dtype=torch.int32, device=dev)
    scan = _kernel("prefill_attention.cu", "prefill_tile_offsets", suffix, d)
    _launch(scan, (1,), (PF_SCAN_THREADS,), (_ptr(cu_seqlens_q), _i32(s), _ptr(tile_offsets)), dev)
    layer_off, block_stride, kv_stride = _cache_strides(kv_cache, layer)
    kernel = _kernel("prefill_attention.cu", f"prefill_attention_varlen_{suffix}_d{d}", suffix, d)
    args = (_ptr(out), _ptr(q), _ptr(kv_cache), _ptr(cu_seqlens_q), _ptr(context_lens),
            _ptr(block_tables), _ptr(tile_offsets), _i32(s), _i32(mb), layer_off, block_stride,
            kv_stride, _i32(h), _i32(kvh), _i32(bs), _f32(scale))
    grid = (math.ceil(n / PF_BM) + s, h)
    _launch(kernel, grid, (PF_THREADS,), args, dev, prefill_smem_bytes(d))
    return out
