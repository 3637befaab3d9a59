"""Decode step ms of a GGUF's Q8_0 codes served packed, against dense bf16 and int4, plus weight MB.

Usage: python benchmarks/gguf_packed_bench.py [--model GGUF] [--batches 1,8,32] [--steps 10] [--threads 2]
           [--rounds 3] [--crossover 16,32,64,128,192]

The model's float weights (SmolLM2's, dequantized from its Q4_1 file, by default) are re-quantized
to Q8_0 with gguf.quants.quantize into a temporary GGUF (deleted afterwards), which is then served
three ways: `packed` (the file's Q8_0 codes as two int4 planes), `dense` (the same codes
dequantized to bf16 at load) and `int4` (round-to-nearest 4-bit of them). Prints one JSON line and
a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_step import step_ms  # noqa: E402
from pdserve.quant.gguf_packed import weights_for  # noqa: E402
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402


def requantize_q8_0(src: Path, out: Path) -> None:
    """A copy of `src` whose 2-D block-quantized tensors are Q8_0 of their dequantized values."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(t.data)
        if len(shape) == 2 and t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            values = gguf.quants.dequantize(data, t.tensor_type).reshape(shape)
            w.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, data.reshape(shape), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def projection_mb(weights: dict, checkpoint) -> float:
    """MB of the decoder projections as the engine holds them (nbytes of their linears)."""
    from pdserve.quant.linear import as_linear

    names = checkpoint.config.arch.projection_names(checkpoint.config)
    return sum(as_linear(weights[n]).nbytes for n in names) / 1e6


SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # one layer's qkv, o, gate|up, down


def crossover(rows: list[int], repeats: int) -> dict[str, dict[int, list[float]]]:
    """ms per layer (SmolLM2's four projections, random codes) of the kernel and of dequantize-then-
    matmul, one and two planes, best of `repeats` interleaved runs: where DENSE_FROM_ROWS* belong."""
    from pdserve.quant.gguf_packed import BlockCodes, int4_codes
    from pdserve.quant.int4_cpu import Int4Linear

    gen = torch.Generator().manual_seed(0)
    layers = {bits: [Int4Linear(int4_codes(BlockCodes(torch.randint(0, 2 ** bits, (n, k), generator=gen,
                                                                    dtype=torch.uint8),
                                                      torch.rand(n, k // 32, generator=gen) * 0.01,
                                                      torch.rand(n, k // 32, generator=gen) * 0.01, bits)))
                     for n, k in SMOLLM2_SHAPES] for bits in (4, 8)}
    best: dict[str, dict[int, list[float]]] = {}
    for _ in range(repeats):
        for m in rows:
            for bits, lins in layers.items():
                kernel = dense = 0.0
                for lin in lins:
                    x = torch.randn(m, lin.in_features, generator=gen).bfloat16()
                    xs = x if lin.planes == 1 else torch.cat([x, x], dim=-1)
                    t0 = time.perf_counter()
                    torch._weight_int4pack_mm_for_cpu(xs, lin.packed, 32, lin.scales_and_zeros)
                    t1 = time.perf_counter()
                    torch.nn.functional.linear(x, lin.dequantized())
                    kernel, dense = kernel + t1 - t0, dense + time.perf_counter() - t1
                key = f"{lin.planes}-plane"
                old = best.setdefault(key, {}).get(m, [float("inf")] * 2)
                best[key][m] = [min(old[0], kernel * 1e3), min(old[1], dense * 1e3)]
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: $PDSERVE_MODEL, else SmolLM2)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--crossover", default=None, help="only time kernel vs dequantize+matmul at these row counts")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.crossover:
        best = crossover([int(r) for r in args.crossover.split(",")], args.rounds)
        print(json.dumps({"threads": args.threads, "layer_ms_kernel_vs_dequantized": best}))
        print(f"{'planes':8} {'rows':>5} {'kernel ms':>10} {'dequant+mm ms':>14}")
        for key, by_rows in best.items():
            for m, (k, d) in by_rows.items():
                print(f"{key:8} {m:5d} {k:10.2f} {d:14.2f}")
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[int, float]] = {}
    mb: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "q8_0.gguf"
        requantize_q8_0(resolve_model_path(args.model), path)
        checkpoint = load_checkpoint(path, dtype=torch.bfloat16)
        engines = {}
        for fmt in ("packed", "int4", "dense"):
            config = EngineConfig(cache=CacheConfig(num_blocks=8 * max(batches), dtype="bfloat16"),
                                  scheduler=SchedulerConfig(max_num_seqs=max(batches)), dtype="bfloat16",
                                  weight_format="auto" if fmt == "packed" else fmt)
            weights, got = weights_for(checkpoint, config)
            assert got == fmt, (fmt, got)
            mb[fmt] = projection_mb(weights, checkpoint)
            engines[fmt] = Engine(checkpoint.config, weights, checkpoint.fingerprint, config,
                                  tokenizer=checkpoint.tokenizer)
        # Rounds interleave the formats, and each figure is the best round's: a shared machine's
        # load then slows every format alike instead of the one that ran during a burst.
        for _ in range(args.rounds):
            for fmt, engine in engines.items():
                for b in batches:
                    ms = step_ms(engine, b, args.steps)
                    results.setdefault(fmt, {})[b] = min(ms, results.get(fmt, {}).get(b, float("inf")))
    print(json.dumps({"model": "Q8_0 of " + str(resolve_model_path(args.model).name), "threads": args.threads,
                      "rounds": args.rounds, "step_ms": results, "projection_mb": mb}))
    print(f"{'format':8} {'proj MB':>8} {'batch':>5} {'step ms':>9} {'tok/s':>8} {'vs dense':>9}")
    for fmt, by_batch in results.items():
        for b, ms in by_batch.items():
            print(f"{fmt:8} {mb[fmt]:8.1f} {b:5d} {ms:9.1f} {b / ms * 1e3:8.0f} {results['dense'][b] / ms:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
