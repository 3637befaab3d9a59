"""Writing one layer's new keys and values into an INT8 paged KV cache on the CPU: the C write
(kernels/cpu/kv_write.c through cpu_kv_write) against kv_quant's torch path, same cache, same run
(ratios, not absolutes).

Usage: python benchmarks/kv_write_bench.py [--threads 1] [--rounds 5]

SmolLM2-135M's KV shape (3 kv heads, head dim 64, 30 layers, blocks of 16) over a 512-block cache;
k and v bf16 as the model passes them (v a strided view of the fused qkv output). Cases: a decode
step of 32 sequences (one row each, in its own block at a random fill) and a 200-token prefill chunk
(13 fresh blocks). Best of `--rounds` rounds of 50 calls each. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from cpu_attention_bench import best_ms  # noqa: E402  (the sibling benchmark's timer)
from pdserve.runtime.kernels import cpu_attention, cpu_kv_write, kv_quant  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, BLOCK, NUM_BLOCKS = 9, 3, 64, 30, 16, 512


def model_rows(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """k (contiguous, as after RoPE) and v (a view into the qkv output): [n, KVH, D] bf16."""
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).bfloat16()
    _, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return k.contiguous().view(n, KV_HEADS, DIM), v.view(n, KV_HEADS, DIM)


def decode_slots(batch: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:batch] + 1
    return blocks * BLOCK + torch.randint(0, BLOCK, (batch,), generator=gen)


def prefill_slots(tokens: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randperm(NUM_BLOCKS - 1, generator=gen)[:-(-tokens // BLOCK)] + 1
    positions = torch.arange(tokens)
    return blocks[positions // BLOCK] * BLOCK + positions % BLOCK


def best_us(fn, rounds: int, calls: int = 50) -> float:
    return best_ms(fn, rounds, calls) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_attention.library() is None:
        print("the C kernel could not be built here (see the log line): nothing to compare", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(NUM_BLOCKS, LAYERS, 2, BLOCK + 1, KV_HEADS, DIM, dtype=torch.int8)
    rows = []
    for case, slots in (("decode 32 seqs", decode_slots(32, gen)), ("prefill 200 tokens", prefill_slots(200, gen))):
        k, v = model_rows(len(slots), gen)
        call = (cache, 7, k, v, slots)
        kernel = best_us(lambda: cpu_kv_write.write_kv(*call), args.rounds)
        reference = best_us(lambda: kv_quant.write_kv(*call), args.rounds)
        rows.append({"case": case, "rows": len(slots), "kernel_us": round(kernel, 1), "torch_us": round(reference, 1),
                     "speedup": round(reference / kernel, 1),
                     "per_step_saved_ms_30_layers": round((reference - kernel) * LAYERS / 1e3, 2)})
    print(json.dumps({"threads": args.threads, "rows": rows}))
    print(f"{'case':20} {'rows':>4} {'torch us':>9} {'kernel us':>9} {'speed-up':>8} {'x30 layers saved ms':>19}")
    for r in rows:
        print(f"{r['case']:20} {r['rows']:4d} {r['torch_us']:9.1f} {r['kernel_us']:9.1f} {r['speedup']:7.1f}x "
              f"{r['per_step_saved_ms_30_layers']:19.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
