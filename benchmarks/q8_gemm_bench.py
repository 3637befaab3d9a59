"""SmolLM2's 30 layers' projections at a decode batch's row count: the VNNI GEMM (int8 inputs, 4-bit codes)
against the dense bf16 copy on oneDNN, weights from memory, in one run (ratios, not absolutes).

Usage: python benchmarks/q8_gemm_bench.py [--rows 8,16,32] [--threads 1] [--rounds 5]

Each layer gets its own random weights (SmolLM2's four projections: fused q/k/v 576 -> 960, o 576 -> 576,
fused gate/up 576 -> 3072, down 1536 -> 576), so a sweep of the 30 layers reads every weight once from
memory as a decode step does (106 MB of codes in the GEMM's layout, 212 MB of bf16). A round times one
sweep of each, alternating; the best round is kept. Prints one JSON line, then a table. On a CPU without
AVX512-VNNI the GEMM's column is null.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.quant.int4_cpu import _nibbles  # noqa: E402
from pdserve.quant.onednn_linear import linear_packed, onednn_packed  # noqa: E402
from pdserve.runtime.kernels import cpu_int4_matmul as kernel  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of a layer's four projections
LAYERS = 30


def layers(gen: torch.Generator) -> tuple[list, list]:
    """(GEMM weights, dense bf16 weights in oneDNN's layout) of LAYERS random layers."""
    gemm, dense = [], []
    for _ in range(LAYERS):
        for k, n in SHAPES:
            codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            scale = torch.rand(n, k // 32, generator=gen) * 0.01
            mins = -8 * scale
            gemm.append((k, kernel.q8_gemm_panels(_nibbles(codes), scale, mins)))
            w = (codes.float().view(n, k // 32, 32) * scale[..., None] + mins[..., None]).view(n, k).bfloat16()
            packed = onednn_packed(w)
            dense.append((k, w if packed is None else packed))
    return gemm, dense


def sweep_ms(call, weights: list, xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for k, w in weights:
        call(xs[k], w)
    return (time.perf_counter() - start) * 1e3


def dense_call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return linear_packed(x, w, None) if w.is_mkldnn else torch.nn.functional.linear(x, w)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gemm, dense = layers(torch.Generator().manual_seed(0))
    runs = kernel.q8_gemm_available()
    result: dict[int, dict[str, float | None]] = {}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        best = {"gemm": float("inf"), "dense": float("inf")}
        for _ in range(args.rounds):
            best["dense"] = min(best["dense"], sweep_ms(dense_call, dense, xs))
            if runs:
                best["gemm"] = min(best["gemm"], sweep_ms(kernel.matmul_q8_gemm, gemm, xs))
        result[m] = {"gemm_ms": round(best["gemm"], 2) if runs else None, "dense_ms": round(best["dense"], 2)}
    print(json.dumps({"threads": args.threads, "vnni_gemm": runs, "amx": kernel.amx_available(), "rows": result}))
    print(f"{'rows':>5} {'GEMM ms':>9} {'dense ms':>9} {'speed-up':>9}")
    for m, r in result.items():
        g, d = r["gemm_ms"], r["dense_ms"]
        gemm_ms, ratio = ("-", "-") if g is None else (f"{g:.2f}", f"{d / g:.2f}x")
        print(f"{m:5d} {gemm_ms:>9} {d:9.2f} {ratio:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
