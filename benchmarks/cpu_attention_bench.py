"""Decode attention of one layer on the CPU: the C kernel reading the paged cache in place against
torch's gather + SDPA path, same cache, same run (ratios, not absolutes).

Usage: python benchmarks/cpu_attention_bench.py [--threads 1] [--shapes 1x48,8x336,32x80,32x336]
           [--kv-dtypes bfloat16,int8] [--rounds 3]

SmolLM2-135M's attention (9 query heads, 3 kv heads, head dim 64, 30 layers, blocks of 16) over a
2,048-block cache with shuffled block tables; each shape is BATCHxCONTEXT. Best of `--rounds` rounds of
20 calls each, each call on the next of the 30 layers (so that, as in a step, a call's keys and values
come from memory, not from the CPU's caches). Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.runtime.kernels import cpu_attention, kv_quant  # noqa: E402
from pdserve.runtime.kernels.torch_ops import paged_decode_attention_torch  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, BLOCK, NUM_BLOCKS = 9, 3, 64, 30, 16, 2048


def cache_for(kv_dtype: str, gen: torch.Generator) -> torch.Tensor:
    """A [NUM_BLOCKS, LAYERS, 2, rows, KVH, D] cache of random values (INT8: codes and a scale row)."""
    values = torch.randn(NUM_BLOCKS, LAYERS, 2, BLOCK, KV_HEADS, DIM, generator=gen).bfloat16()
    if kv_dtype == "bfloat16":
        return values
    codes = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK + 1, KV_HEADS, DIM, dtype=torch.int8)
    for layer in range(LAYERS):
        codes[:, layer, :, :BLOCK], scales = kv_quant.quantize_heads(values[:, layer], torch.int8)
        kv_quant.scales_view(codes)[:, layer] = scales
    return codes


def layer_cycle(attend, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):
    """A call of `attend` on the next layer each time, as a decode step's layers follow each other: one
    layer's keys and values (8 MB at 32 x 336) would stay in the CPU's caches over repeated calls, the
    30 layers' (250 MB) do not, so each call reads its cache from memory as in a step."""
    layer = iter(range(1 << 62))
    return lambda: attend(q, cache, next(layer) % LAYERS, tables, lens, DIM ** -0.5)


def best_ms(fn, rounds: int, calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default="1x48,8x336,32x80,32x336")
    p.add_argument("--kv-dtypes", default="bfloat16,int8")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_attention.library() is None:
        print("the C kernel could not be built here (see the log line): nothing to compare", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kv_dtype in args.kv_dtypes.split(","):
        cache = cache_for(kv_dtype, gen)
        for shape in args.shapes.split(","):
            batch, context = (int(x) for x in shape.split("x"))
            width = -(-context // BLOCK)
            tables = (torch.randperm(NUM_BLOCKS - 1, generator=gen)[:batch * width] + 1).view(batch, width)
            lens = torch.full((batch,), context, dtype=torch.int64)
            q = torch.randn(batch, HEADS, DIM, generator=gen).bfloat16()
            kernel = best_ms(layer_cycle(cpu_attention.paged_decode_attention, q, cache, tables, lens), args.rounds)
            reference = best_ms(layer_cycle(paged_decode_attention_torch, q, cache, tables, lens), args.rounds)
            rows.append({"kv_dtype": kv_dtype, "batch": batch, "context": context, "kernel_ms": round(kernel, 3),
                         "torch_ms": round(reference, 3), "speedup": round(reference / kernel, 2)})
    print(json.dumps({"threads": args.threads, "rows": rows}))
    print(f"{'kv':8} {'batch':>5} {'context':>7} {'torch ms':>9} {'kernel ms':>9} {'speed-up':>8}")
    for r in rows:
        print(f"{r['kv_dtype']:8} {r['batch']:5d} {r['context']:7d} {r['torch_ms']:9.2f} {r['kernel_ms']:9.2f} "
              f"{r['speedup']:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
