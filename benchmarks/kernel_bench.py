"""Paged decode attention on a GPU: our CuPy kernel vs the torch reference vs dense SDPA.

Usage: python benchmarks/kernel_bench.py [--dtype bf16] [--iters 50]

For batch 1/8/32/64 x context 512/2048/8192 (head dim 128, 32 query heads over 4 kv heads:
GQA 8), every sequence at the full context with its blocks scattered randomly in the cache,
times with CUDA events
  cupy   cuda_ops.paged_decode_attention (split-K kernel over the paged cache)
  torch  torch_ops.paged_decode_attention (gather + SDPA: the reference)
  sdpa   F.scaled_dot_product_attention on KV already gathered dense (gather not timed):
         what a contiguous cache would cost
and reports microseconds, achieved bandwidth (bytes of K and V read / time) and the ratios.
Prints one JSON line (machine-readable) and then a table. Exits with a message without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

BATCHES = (1, 8, 32, 64)
CONTEXTS = (512, 2048, 8192)
HEAD_DIM, HEADS, KV_HEADS, BLOCK_SIZE = 128, 32, 4, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_us(fn, iters: int, warmup: int = 5) -> float:
    """Median over `iters` of a CUDA-event timed call, in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def bench_case(batch: int, context: int, dtype: torch.dtype, iters: int) -> dict:
    from pdserve.runtime.kernels import cuda_ops, torch_ops  # noqa: PLC0415

    dev = torch.device("cuda")
    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    tables = torch.randperm(num_blocks, device=dev).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int64, device=dev)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    scale = HEAD_DIM ** -0.5

    blocks = cache[tables, 0]  # [B, MB, 2, BS, KVH, D], gathered once for the dense baseline
    k = blocks[:, :, 0].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    v = blocks[:, :, 1].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    del blocks

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    ours = cuda_ops.paged_decode_attention(q, cache, 0, tables, lens, scale)
    ref = torch_ops.paged_decode_attention(q, cache, 0, tables, lens, scale)
    max_err = (ours.float() - ref.float()).abs().max().item()

    t_cupy = time_us(lambda: cuda_ops.paged_decode_attention(q, cache, 0, tables, lens, scale), iters)
    t_torch = time_us(lambda: torch_ops.paged_decode_attention(q, cache, 0, tables, lens, scale), iters)
    t_sdpa = time_us(sdpa, iters)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * cache.element_size()
    return {
        "batch": batch, "context": context, "kv_bytes": kv_bytes, "max_abs_err_vs_torch": max_err,
        "cupy_us": t_cupy, "torch_us": t_torch, "sdpa_dense_us": t_sdpa,
        "cupy_gbps": kv_bytes / t_cupy / 1e3, "torch_gbps": kv_bytes / t_torch / 1e3,
        "sdpa_dense_gbps": kv_bytes / t_sdpa / 1e3,
        "speedup_vs_torch": t_torch / t_cupy, "speedup_vs_sdpa_dense": t_sdpa / t_cupy,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device (torch.cuda.is_available() is False); nothing to time.",
              file=sys.stderr)
        return 2
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        print("kernel_bench: cupy is not installed (pip install 'pdserve[gpu]').", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    rows = [bench_case(b, c, dtype, args.iters) for b in BATCHES for c in CONTEXTS]
    print(json.dumps({"bench": "paged_decode_attention", "device": torch.cuda.get_device_name(),
                      "dtype": args.dtype, "head_dim": HEAD_DIM, "heads": HEADS, "kv_heads": KV_HEADS,
                      "block_size": BLOCK_SIZE, "results": rows}))
    header = (f"{'batch':>5} {'ctx':>5} | {'cupy us':>8} {'GB/s':>6} | {'torch us':>9} {'GB/s':>6} | "
              f"{'sdpa us':>8} {'GB/s':>6} | {'x torch':>7} {'x sdpa':>6} | {'max err':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>5} | {r['cupy_us']:>8.1f} {r['cupy_gbps']:>6.0f} | "
              f"{r['torch_us']:>9.1f} {r['torch_gbps']:>6.0f} | {r['sdpa_dense_us']:>8.1f} "
              f"{r['sdpa_dense_gbps']:>6.0f} | {r['speedup_vs_torch']:>7.2f} {r['speedup_vs_sdpa_dense']:>6.2f} | "
              f"{r['max_abs_err_vs_torch']:>8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
