"""An 8-bit output head's bf16 matmul on the CPU, its weights from memory as in a decode step: the
codes' AVX512-BF16 kernel, the codes' AMX kernel (kernels/cpu/int4_amx.c) and the dense bf16 weight
(oneDNN's packed layout, the baseline), same weights, same run (ratios, not absolutes).

Usage: python benchmarks/q8_head_bench.py [--threads 1] [--rows 1,4,8,16,32,48,64,128] [--rounds 9]

SmolLM2-135M's head shape (49152 x 576) with random Q8_0 codes and scales. Before each call a 256 MB
buffer is written, so that the weights come from memory as they do in a step (a step's KV and
projections pass between two heads). Median of `--rounds` calls. A kernel that does not run here
(no AVX512-BF16, no AMX) is reported as null. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.quant.onednn_linear import linear_packed, onednn_packed  # noqa: E402
from pdserve.runtime.kernels import cpu_int4_matmul  # noqa: E402

VOCAB, HIDDEN, GROUP = 49152, 576, 32


def cold_call_s(fn, flush: torch.Tensor) -> float:
    """Seconds of one call of fn after `flush` is written (the weights pushed out of the caches)."""
    flush.add_(1.0)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_cold_ms(fn, rounds: int, flush: torch.Tensor) -> float | None:
    """fn's median cold time; None where fn does not run here."""
    if fn() is None:
        return None
    return statistics.median(cold_call_s(fn, flush) for _ in range(rounds)) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,4,8,16,32,48,64,128")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
    scale = torch.rand((VOCAB, HIDDEN // GROUP), generator=gen) * 1e-3
    dense = (codes.float().view(VOCAB, -1, GROUP) * scale[..., None]).view(VOCAB, HIDDEN).bfloat16()
    packed = onednn_packed(dense)
    blocks = cpu_int4_matmul.amx_int8_blocks(codes, scale) if cpu_int4_matmul.amx_available() else None
    flush = torch.zeros(64 * 1024 * 1024)  # 256 MB
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn((m, HIDDEN), generator=gen).bfloat16()
        dense_ms = median_cold_ms((lambda: linear_packed(x, packed, None)) if packed is not None
                                  else (lambda: F.linear(x, dense)), args.rounds, flush)
        codes_ms = median_cold_ms(lambda: cpu_int4_matmul.matmul_int8_bf16(x, codes, scale), args.rounds, flush)
        amx_ms = None if blocks is None else median_cold_ms(
            lambda: cpu_int4_matmul.matmul_int8_amx(x, blocks, VOCAB), args.rounds, flush)
        rows.append({"rows": m, "dense_bf16_ms": round(dense_ms, 2),
                     "codes_avx512_ms": None if codes_ms is None else round(codes_ms, 2),
                     "codes_amx_ms": None if amx_ms is None else round(amx_ms, 2),
                     "amx_vs_dense": None if amx_ms is None else round(dense_ms / amx_ms, 2)})
    print(json.dumps({"threads": args.threads, "dense_layout": "onednn" if packed is not None else "plain",
                      "rows": rows}))
    print(f"{'rows':>4} {'dense bf16 ms':>13} {'codes AVX-512 ms':>16} {'codes AMX ms':>12} {'AMX speed-up':>12}")
    for r in rows:
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-"
                 for k in ("dense_bf16_ms", "codes_avx512_ms", "codes_amx_ms")]
        ratio = "-" if r["amx_vs_dense"] is None else f"{r['amx_vs_dense']:.2f}x"
        print(f"{r['rows']:4d} {cells[0]:>13} {cells[1]:>16} {cells[2]:>12} {ratio:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
