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

import math

import torch

try:
    import cupy
except Exception as exc:  # ImportError, or a cupy that cannot load its CUDA libraries
    raise ImportError(f"pdserve.runtime.kernels.cuda_ops needs a working cupy: {exc}") from exc

from pdserve.runtime.kernels import torch_ops, torch_varlen
from pdserve.runtime.kernels.cuda_launch import (  # noqa: F401 - kernel_source, compile_options: tests
    DECODE_THREADS,
    DEFAULT_SMEM_LIMIT,
    MAX_DECODE_PARTITIONS,
    PF_BM,
    PF_BN,
    PF_PAD,
    PF_SCAN_THREADS,
    PF_THREADS,
    _cache_strides,
    _check_aligned,
    _check_cache,
    _check_contiguous,
    _check_cuda,
    _check_head_dim,
    _check_index,
    _check_same_dtype,
    _f32,
    _float_suffix,
    _i32,
    _i64,
    _kernel,
    _launch,
    _norm_threads,
    _ptr,
    _row_stride,
    _rows,
    _sm_count,
    compile_options,
    kernel_head_dim,
    kernel_source,
)

rope_cos_sin = torch_ops.rope_cos_sin  # host-side tables: same function on every backend


SCALED_SUFFIX = {torch.int8: "i8", torch.float8_e4m3fn: "fp8"}  # paged_attention.cu's scaled caches


def _scaled(kv_cache: torch.Tensor) -> bool:
    """An int8 / fp8 cache with scale rows (`pdserve.runtime.kv_cache`): written and prefilled by the
    torch path (`kv_quant`, on the GPU: a write requantizes blocks as their range grows); decode
    attention reads it in the kernel."""
    return kv_cache.dtype in SCALED_SUFFIX


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
    if _scaled(kv_cache):
        return torch_ops.write_kv(kv_cache, layer, k, v, slot_mapping)
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
    """Checks q [N, H, D] against the cache; returns (dtype suffix, H, KVH, D, block_size).

    A scaled cache (int8 / fp8 codes) holds one row more than its block size: the scales."""
    _, _, bs, kvh, d, dtype = _check_cache(kv_cache, layer)
    _check_cuda(q, "q", kv_cache.device)
    suffix = _float_suffix(q, "q")
    if _scaled(kv_cache):
        bs -= 1
    else:
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


def _kernels_take(kv_cache: torch.Tensor) -> bool:
    """False for a cache of another head dim (a toy model's, stories260K's 8): its attention runs
    the torch reference on the GPU instead. A malformed cache goes on to the kernels' checks."""
    return kv_cache.dim() != 6 or kernel_head_dim(kv_cache.shape[5])


def _prefill_kernels_take(kv_cache: torch.Tensor) -> bool:
    """The prefill kernels also read float caches only: a scaled one (int8 / fp8 codes) prefills
    through the torch reference, which dequantizes the blocks it gathers."""
    return not _scaled(kv_cache) and _kernels_take(kv_cache)


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
    if not _kernels_take(kv_cache):
        return torch_ops.paged_decode_attention_torch(q, kv_cache, layer, block_tables, context_lens, scale)
    suffix, h, kvh, d, bs = _check_attention_q(q, kv_cache, layer)
    cache_suffix = f"_{SCALED_SUFFIX[kv_cache.dtype]}" if _scaled(kv_cache) else ""
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
    item = kv_cache.element_size()  # the kernel's row split follows the cache's element size
    p = decode_partition_size(b, kvh, max_context, group, d, item, _sm_count(index))
    num_parts = math.ceil(max_context / p)
    smem = decode_smem_bytes(group, d, p, item)
    layer_off, block_stride, kv_stride = _cache_strides(kv_cache, layer)
    kernel = _kernel("paged_attention.cu", f"paged_decode_attention_{suffix}{cache_suffix}_d{d}", suffix, d)
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
    if not _prefill_kernels_take(kv_cache):
        return torch_ops.prefill_attention(q, kv_cache, layer, block_table, context_len, scale)
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
    if not _prefill_kernels_take(kv_cache):
        return torch_varlen.prefill_attention_varlen(q, kv_cache, layer, cu_seqlens_q, context_lens,
                                                     block_tables, scale)
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
