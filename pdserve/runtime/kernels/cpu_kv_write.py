"""Writing new keys and values into an INT8 paged KV cache on the CPU with the C function of
kernels/cpu/kv_write.c (built into cpu_attention's library).

`kv_quant.write_kv` (the reference, and the FP8 / GPU path) is dozens of small torch ops per layer
per step; at 32 decode streams of SmolLM2 that cost what the INT8 read saves. The C function does
the same write with the same bits (scale upkeep, requantize of grown blocks, round half to even) in
one pass. `write_kv` returns False where it does not apply (no library, another format or input
dtype, a slot out of range): the caller then runs kv_quant's path, which decides what that means.
"""

from __future__ import annotations

import torch

from pdserve.runtime.kernels import cpu_attention

# The C write runs where it applies; off, every INT8 write takes kv_quant's torch path (the
# reference: tests and benchmarks compare the two through this switch).
ENABLED = True
_INPUT_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x: [N, KVH, D] with each row's KVH * D values contiguous (a strided view of the fused qkv output
    is), else a contiguous copy: the C side takes one stride per row."""
    stride = x.stride()
    return x if stride[2] == 1 and (stride[1] == x.shape[2] or x.shape[1] == 1) else x.contiguous()


def supports(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C write runs this call: an INT8 cache on the CPU, contiguous, k and v [N, KVH, D] of
    the cache's KVH and D and of one dtype (fp32 or bf16), and the library built."""
    return (ENABLED and kv_cache.dtype == torch.int8 and kv_cache.is_cpu and k.is_cpu and v.is_cpu
            and k.dtype == v.dtype and k.dtype in _INPUT_SUFFIX and k.dim() == 3 and v.shape == k.shape
            and kv_cache.shape[4:] == k.shape[1:] and kv_cache.is_contiguous() and cpu_attention.library() is not None)


def write_kv(kv_cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Quantizes k, v: [N, KVH, D] into their slots (slot = block_id * block_size + offset) as
    `kv_quant.write_kv` does, bit for bit; False (nothing written) where this kernel does not apply."""
    if not supports(kv_cache, k, v):
        return False
    n, kvh, d = k.shape
    if n == 0:
        return True
    k, v = _rows_of(k), _rows_of(v)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    slots = slots.contiguous()  # (a no-op where it already is)
    num_blocks, layers, _, rows, _, _ = kv_cache.shape
    run = rows * kvh * d  # bytes of one (block, layer, k/v) run: its tokens, then the scale row
    fn = getattr(cpu_attention.library(), f"kv_write_int8_{_INPUT_SUFFIX[k.dtype]}")
    return fn(kv_cache.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), slots.data_ptr(), n,
              num_blocks, kvh, d, rows - 1, layers * 2 * run, 2 * layer * run) == 0
