"""The pipeline bubble: per stage, the fraction of a decode step it idles, at 1, 2 and 4 micro-batches,
on the SmolLM2-sized random Llama of tp_bench.py (576 hidden, 1536 MLP, 30 layers, 49152 vocabulary).

Usage: python benchmarks/pp_bench.py [--stages 2] [--tp 1] [--micro-batches 1,2,4] [--batch 8]
           [--steps 8] [--layers 30] [--cores N] [--device cpu|cuda]

A PP-M engine (real stages, one process each, gloo) decodes `--batch` sequences; per micro-batch
count, 2 warm-up steps, then `--steps` timed decode steps. Each stage counts the seconds it computes
(its layers; the embedding on stage 0, the final norm and head on the last); a stage's bubble is
1 - its compute time / the pipeline's time (rank 0's, from sending the step to holding its logits).
Forward-only pipelining predicts (M-1)/(k+M-1) for stages of equal cost. A PP-1 engine's step
time at the same total cores is the baseline. Prints one JSON line, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint  # noqa: E402
from pdserve.runtime.parallel.group import ParallelConfig  # noqa: E402
from pdserve.runtime.parallel.launch import tensor_parallel_engine  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402
from tp_bench import PROMPT, write_checkpoint  # noqa: E402


def decode_steps(engine: Engine, tag: str, batch: int, steps: int, driver=None) -> dict:
    """`steps` timed decode steps of `batch` sequences; with a pipeline driver, each stage's time."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [3 + (i * 7 + j) % 40000 for j in range(PROMPT)], params)
    for _ in range(3):  # the prefill, then warm-up decodes
        engine.step()
    if driver is not None:
        driver.stage_stats(reset=True)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    row = {"step_ms": 1e3 * wall / steps, "tokens_per_s": batch * steps / wall}
    if driver is not None:
        stats = driver.stage_stats(reset=True)
        pipeline_s = stats[0].step_s
        row["pipeline_ms"] = 1e3 * pipeline_s / steps
        row["stage_busy_ms"] = [1e3 * s.busy_s / steps for s in stats]  # per rank: stage-major
        row["stage_bubble"] = [1.0 - s.busy_s / pipeline_s for s in stats]
    while engine.has_unfinished():
        engine.step()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--micro-batches", default="1,2,4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=256), scheduler=SchedulerConfig(),
                          device=args.device)
    m = args.stages
    results = []
    with tempfile.TemporaryDirectory(prefix="pp-bench-") as tmp:
        path = write_checkpoint(Path(tmp), args.layers)
        torch.set_num_threads(args.cores)
        results.append({"stages": 1, "micro_batches": 1, "threads_per_rank": args.cores,
                        **decode_steps(Engine.from_checkpoint(load_checkpoint(path), config), "pp1", args.batch,
                                       args.steps)})
        threads = max(1, args.cores // (m * args.tp))
        parallel = ParallelConfig(args.tp, collective_timeout_s=60.0, pipeline_parallel_size=m)
        engine, handle = tensor_parallel_engine(path, config, parallel, threads=threads)
        driver = engine.runner.model
        try:
            for k in map(int, args.micro_batches.split(",")):
                driver.micro_batches, driver.micro_batch_rows = k, 1  # k pieces, however small
                row = decode_steps(engine, f"k{k}", args.batch, args.steps, driver)
                results.append({"stages": m, "tp": args.tp, "micro_batches": k, "threads_per_rank": threads,
                                "predicted_bubble": (m - 1) / (k + m - 1), **row})
        finally:
            handle.close()
    print(json.dumps({"device": args.device, "layers": args.layers, "cores": args.cores, "batch": args.batch,
                      "results": results}))
    print(f"{'PP':>3} {'k':>3} {'step ms':>8} {'tok/s':>7} {'pipeline ms':>11} {'busy ms per rank':>20} "
          f"{'bubble per rank':>18} {'predicted':>9}")
    for r in results:
        busy = " ".join(f"{b:.0f}" for b in r.get("stage_busy_ms", []))
        bubble = " ".join(f"{b:.2f}" for b in r.get("stage_bubble", []))
        pred = f"{r['predicted_bubble']:.2f}" if "predicted_bubble" in r else ""
        print(f"{r['stages']:>3} {r['micro_batches']:>3} {r['step_ms']:>8.1f} {r['tokens_per_s']:>7.1f} "
              f"{r.get('pipeline_ms', r['step_ms']):>11.1f} {busy:>20} {bubble:>18} {pred:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
