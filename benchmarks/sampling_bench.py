"""Drawing the next tokens of a decode step: the sampler (every sampled row in one batch,
pdserve.runtime.token_draw) beside the per-row path it replaced (a softmax, the filters by a sort of
the vocabulary and `torch.multinomial`, a row at a time), on the same logits, in one run.

Usage: python benchmarks/sampling_bench.py [--model GGUF] [--rows 1,8,32] [--threads 1] [--repeats 20]

--threads: the OpenMP threads the calling thread holds, as a worker's engine thread holds them (the
sampler draws on one of them; the per-row path uses them all).

The logits are a real decode step's: `max(rows)` chat-like prompts prefilled and decoded greedily
for a few steps by the engine (default model: SmolLM2's GGUF, or $PDSERVE_MODEL), the last step's
logits kept. Each configuration's draws are timed (median of --repeats) for the first `rows` rows.
Prints one JSON line, then a table with the per-row path's time over the sampler's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.runtime.compute_threads import claim, one_thread_by_default  # noqa: E402
from pdserve.runtime.config import EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402
from pdserve.runtime.sampler import sample  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402
from pdserve.runtime.sequence import Sequence  # noqa: E402

# Sampled rows only: greedy rows were one batched max before and are now.
CONFIGS = {
    "T 0.7": SamplingParams(temperature=0.7),
    "T 0.7, top_p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T 0.8, top_k 40, top_p 0.95, min_p 0.05": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "T 1.0, top_p 0.9, seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
}
TOPICS = ["a dragon who learns to cook", "the history of the printing press", "how vaccines work",
          "a letter to a friend abroad", "the rules of chess", "a haiku about autumn rain",
          "why the sky is blue", "a recipe for bread", "the life of a honeybee", "a trip to the moon"]


def per_row_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The path before: logits [V] -> a softmax, the filters by a sort, `torch.multinomial`."""
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    if params.top_k > 0 or params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if params.top_k > 0:
            keep[params.top_k:] = False
        if params.top_p < 1.0:
            keep &= (sorted_p.cumsum(0) - sorted_p) < params.top_p * sorted_p.sum()
        keep[0] = True
        probs = torch.zeros_like(probs)
        probs[order[keep]] = sorted_p[keep]
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def decode_logits(model: str | None, rows: int, threads: int) -> tuple[torch.Tensor, str]:
    """[rows, V] fp32: the logits of a greedy decode step of `rows` chat-like prompts."""
    checkpoint = load_checkpoint(resolve_model_path(model))
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=rows)))
    for i in range(rows):
        prompt = engine.tokenizer.encode(f"Write about {TOPICS[i % len(TOPICS)]}, part {i // len(TOPICS) + 1}.")
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.keep_logits = True
    while engine.has_unfinished():
        engine.step()
        if engine.last_logits is not None and engine.last_logits.shape[0] == rows:
            logits = engine.last_logits.float().clone()
    return logits, checkpoint.source.name


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: $PDSERVE_MODEL, else SmolLM2)")
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    claim(one_thread_by_default(args.threads))  # as a worker's engine thread holds its threads
    logits, model = decode_logits(args.model, max(row_counts), args.threads)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name, params in CONFIGS.items():
        results[name] = {}
        for n in row_counts:
            seqs = [Sequence(f"s{i}", [1], params) for i in range(n)]
            batched = median_ms(lambda: sample(logits[:n], seqs), args.repeats)
            per_row = median_ms(lambda: [per_row_sample(logits[i], params, s.generator()) for i, s in enumerate(seqs)],
                                args.repeats)
            results[name][n] = {"sampler_ms": batched, "per_row_ms": per_row}
    print(json.dumps({"model": model, "vocab": logits.shape[1], "threads": args.threads, "results": results}))
    print(f"{'sampling':42} {'rows':>4} {'per-row ms':>11} {'sampler ms':>11} {'ratio':>7}")
    for name, by_rows in results.items():
        for n, r in by_rows.items():
            print(f"{name:42} {n:4d} {r['per_row_ms']:11.2f} {r['sampler_ms']:11.2f} "
                  f"{r['per_row_ms'] / r['sampler_ms']:6.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
