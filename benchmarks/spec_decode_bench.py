"""Speculative decoding by prompt n-gram lookup: TPOT and tok/s with and without, acceptance rate.

Usage: python benchmarks/spec_decode_bench.py [--model GGUF] [--dtype auto] [--k 4] [--streams 1,8]
           [--max-tokens 128] [--repeats 3] [--threads 2] [--json PATH]

Three greedy chat-template prompts (SmolLM2-Instruct by default): a chat question, a summary of a
paragraph, and a code edit (copy-heavy: the answer repeats most of the prompt's code). For each
prompt and stream count, plain decoding and speculation (`--k` draft tokens, speculation allowed
up to the stream count) run alternately `--repeats` times on one engine (the machine is shared:
alternating keeps drift out of the ratio); medians are reported. At N streams, N copies of the
prompt run together. TPOT: (last token - first token) / (tokens - 1) per request; tok/s: output
tokens / wall time of the batch. The outputs of both modes are compared token for token.
Prints one JSON object, then a table.
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

from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_compute_dtype  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402
from pdserve.runtime.sampling_params import SamplingParams  # noqa: E402
from pdserve.runtime.speculative import SpeculativeConfig  # noqa: E402

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, age, email = line.split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def oldest(users):
    best = None
    for u in users:
        if best is None or u["age"] > best["age"]:
            best = u
    return best
'''
ARTICLE = ("The city council met on Tuesday to discuss the new public library. The library will be built on the "
           "site of the old train station, next to the river. It will have three floors, a children's reading "
           "room, a cafe and space for two hundred bicycles. Construction starts in March and should take two "
           "years. The council expects the library to cost twelve million euros, of which the national "
           "government pays half. Some residents asked whether the old station clock could be kept; the "
           "architect said the clock will be restored and hung in the main hall.")
PROMPTS = {
    "chat": "What are three simple tips for staying healthy? Explain each in a sentence.",
    "summarise": f"Summarise this article in three sentences, keeping its facts:\n\n{ARTICLE}",
    "code-edit": f"Rename the function `load_users` to `read_users` and the variable `u` to `user` in this code. "
                 f"Reply with the whole updated code only.\n\n```python\n{CODE}```",
}


def run_batch(engine: Engine, prompt: list[int], streams: int, max_tokens: int, tag: str) -> dict:
    """`streams` copies of `prompt` at once; per-request token times."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seqs = [engine.add_request(f"{tag}-{i}", prompt, params) for i in range(streams)]
    times: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times[o.request_id].extend([now] * len(o.new_token_ids))
    wall = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in seqs)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {"tok_s": tokens / wall, "tpot_ms": statistics.median(tpots) * 1e3 if tpots else 0.0,
            "ttft_ms": statistics.median(t[0] - start for t in times.values()) * 1e3,
            "tokens": tokens, "outputs": [s.output_ids for s in seqs]}


def measure(engine: Engine, prompt: list[int], streams: int, args: argparse.Namespace) -> dict:
    spec = SpeculativeConfig(num_tokens=args.k, min_ngram=args.min_ngram, max_ngram=args.max_ngram,
                             max_batch_size=streams)
    runs: dict[str, list[dict]] = {"plain": [], "spec": []}
    drafted = accepted = verifies = 0
    for r in range(args.repeats):
        for mode in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
            engine.set_speculative(spec if mode == "spec" else SpeculativeConfig())
            before = (engine.stats.spec_draft_tokens, engine.stats.spec_accepted_tokens, engine.stats.spec_verifies)
            runs[mode].append(run_batch(engine, prompt, streams, args.max_tokens, f"{mode}{streams}-{r}"))
            if mode == "spec":
                drafted += engine.stats.spec_draft_tokens - before[0]
                accepted += engine.stats.spec_accepted_tokens - before[1]
                verifies += engine.stats.spec_verifies - before[2]
    result = {mode: {key: round(statistics.median(x[key] for x in rs), 2) for key in ("tok_s", "tpot_ms", "ttft_ms")}
              | {"tokens": rs[0]["tokens"]} for mode, rs in runs.items()}
    result["same_output"] = all(x["outputs"] == runs["plain"][0]["outputs"] for x in runs["plain"] + runs["spec"])
    result["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
    result["accepted_per_verify"] = round(accepted / verifies, 2) if verifies else 0.0
    result["speedup_tok_s"] = round(result["spec"]["tok_s"] / result["plain"]["tok_s"], 2)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: $PDSERVE_MODEL, else SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--min-ngram", type=int, default=1)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--streams", default="1,8")
    p.add_argument("--prompts", default=",".join(PROMPTS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_compute_dtype(args.dtype)
    checkpoint = load_checkpoint(resolve_model_path(args.model), dtype=getattr(torch, dtype))
    streams = [int(s) for s in args.streams.split(",")]
    config = EngineConfig(cache=CacheConfig(num_blocks=64 * max(streams), dtype=dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max(streams)), dtype=dtype, weight_format="dense")
    engine = Engine.from_checkpoint(checkpoint, config)
    tok = checkpoint.tokenizer
    encoded = {name: tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_bos=False)
               for name, text in PROMPTS.items() if name in args.prompts.split(",")}
    run_batch(engine, encoded["chat"] if "chat" in encoded else next(iter(encoded.values())), 1, 8, "warm")
    results = {name: {n: measure(engine, ids, n, args) for n in streams} for name, ids in encoded.items()}
    engine.check_leaks()
    data = {"model": checkpoint.source.name, "dtype": dtype, "threads": args.threads, "k": args.k,
            "ngram": [args.min_ngram, args.max_ngram], "max_tokens": args.max_tokens, "repeats": args.repeats,
            "prompt_tokens": {name: len(ids) for name, ids in encoded.items()}, "results": results}
    print(json.dumps(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    print(f"{'prompt':10} {'streams':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'plain TPOT':>10} "
          f"{'spec TPOT':>9} {'accept':>6} {'acc/step':>8} {'same':>5}")
    for name, by_streams in results.items():
        for n, r in by_streams.items():
            print(f"{name:10} {n:7d} {r['plain']['tok_s']:11.1f} {r['spec']['tok_s']:10.1f} {r['speedup_tok_s']:6.2f}x "
                  f"{r['plain']['tpot_ms']:8.1f}ms {r['spec']['tpot_ms']:7.1f}ms {r['acceptance_rate']:6.2f} "
                  f"{r['accepted_per_verify']:8.2f} {str(r['same_output']):>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
