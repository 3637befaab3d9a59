"""What tensor parallelism costs on this machine: decode tokens/s and all-reduce time per step at
TP 1, 2, ... on a SmolLM2-sized random Llama (576 hidden, 1536 MLP, 30 layers, 49152 vocabulary;
8 heads of 72 and 4 KV heads instead of SmolLM2's 9 and 3, which no degree but 1 and 3 splits).

Usage: python benchmarks/tp_bench.py [--degrees 1,2] [--batches 1,8] [--steps 16] [--layers 30]
           [--cores N] [--device cpu|cuda]

A random checkpoint is written to a temporary directory (every rank loads it, as a worker's ranks
load --model). Per degree and batch: B sequences of 32-token prompts are prefilled, 2 decode
steps warm up, then `--steps` decode steps are timed around `Engine.step()`. The all-reduce time is
rank 0's, measured around each all-reduce (it includes waiting for the slower rank: on a CPU
whose cores the ranks share, that is where the imbalance shows). Each degree gets `--cores`
threads in all (cores / degree per rank), so TP 2 uses no more CPU than TP 1. Prints one JSON line,
then a table.
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

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint  # noqa: E402
from pdserve.runtime.parallel.group import ParallelConfig  # noqa: E402
from pdserve.runtime.parallel.launch import tensor_parallel_engine  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402

PROMPT = 32


def write_checkpoint(folder: Path, layers: int) -> Path:
    import transformers

    from pdserve.quant.checkpoint import write_gguf_tokenizer

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                      head_dim=72, max_position_embeddings=2048, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    write_gguf_tokenizer(Path(__file__).resolve().parents[1] / "tests/fixtures/stories260K/stories260K.gguf",
                         folder / "tokenizer.gguf")  # any tokenizer: the bench sends token ids
    return folder


def measure(engine: Engine, group, batch: int, steps: int) -> dict:
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [3 + (i * 7 + j) % 40000 for j in range(PROMPT)], params)
    for _ in range(3):  # the prefill, then warm-up decodes
        engine.step()
    if group is not None:
        group.timed, group.stats.all_reduces, group.stats.all_reduce_s = True, 0, 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    row = {"batch": batch, "step_ms": 1e3 * wall / steps, "tokens_per_s": batch * steps / wall,
           "all_reduce_ms_per_step": 0.0, "all_reduces_per_step": 0}
    if group is not None:
        group.timed = False
        row["all_reduce_ms_per_step"] = 1e3 * group.stats.all_reduce_s / steps
        row["all_reduces_per_step"] = group.stats.all_reduces // steps
    while engine.has_unfinished():
        engine.step()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--degrees", default="1,2")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=256), scheduler=SchedulerConfig(),
                          device=args.device)
    results = []
    with tempfile.TemporaryDirectory(prefix="tp-bench-") as tmp:
        path = write_checkpoint(Path(tmp), args.layers)
        for degree in map(int, args.degrees.split(",")):
            threads = max(1, args.cores // degree)
            if degree == 1:
                torch.set_num_threads(threads)
                engine, handle = Engine.from_checkpoint(load_checkpoint(path), config), None
            else:
                engine, handle = tensor_parallel_engine(path, config, ParallelConfig(degree, 60.0), threads=threads)
            try:
                for batch in map(int, args.batches.split(",")):
                    results.append({"degree": degree, "threads_per_rank": threads,
                                    **measure(engine, handle.group if handle else None, batch, args.steps)})
            finally:
                if handle is not None:
                    handle.close()
    print(json.dumps({"device": args.device, "layers": args.layers, "cores": args.cores, "results": results}))
    print(f"{'TP':>3} {'batch':>5} {'step ms':>9} {'tok/s':>8} {'all-reduce ms/step':>19} {'ARs/step':>8}")
    for r in results:
        print(f"{r['degree']:>3} {r['batch']:>5} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.1f} "
              f"{r['all_reduce_ms_per_step']:>19.1f} {r['all_reduces_per_step']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
