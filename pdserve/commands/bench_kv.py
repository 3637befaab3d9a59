"""`pdserve bench-kv`: what the KV store's caching and prefetch buy, measured on a real stack.

Scenarios (`--scenario`, default all):
  shared-prefix  requests sharing a long prefix (default 1,000 tokens, 200 requests) on a random
                 Llama (hidden 512, 8 layers) that the benchmark builds and saves as an HF
                 directory in a temp folder; TTFT P50/P99 with caching on (shared prefix) vs off
                 (the same prompts made unshareable by a distinct first token).
  sessions       multi-turn sessions: each opens with a document of its own (--context-tokens),
                 and each turn's prompt is the previous prompt, its answer and a new line; their KV
                 is larger than the workers' paged caches (--worker-blocks) and the kvstore's
                 memory tier (--memory-mb), with Redis holding the rest. Session prefetch off vs
                 on (same seed, same think times: --think-model). Reported: the prefill hit rate
                 (of the history blocks each Prefill reused, the fraction already in the prefill
                 worker's paged cache when the turn arrived: it decides TTFT), the decode hit rate
                 (all blocks each Decode needed, and those that existed before the turn), TTFT
                 P50/P99 of the turns after the first (and from the third on), where each block
                 came from, and every session prefetch's outcome. Model: a random Llama
                 (--session-model, default llama-256x8: 32 KiB of KV per token).
  transfer       MB/s of KV blocks (64 KiB of KV per token, 16-token blocks) prefill -> kvstore
                 -> decode through the kvstore's gRPC API, vs raw pipelined Redis SET/GET of the
                 same bytes, in the same run.
Prints one JSON object and a table. Needs redis-server on PATH (or --redis-server) for the
sessions and transfer scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.redis_process import RedisProcess

NAME = "bench-kv"
HELP = "benchmark prefix caching, session prefetch and KV transfer (kvstore + Redis)"

SCENARIOS = ("shared-prefix", "sessions", "transfer")


# stories260K (512-token vocabulary), kept in the repository for the tests; not the served default.
STORIES_GGUF = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "stories260K" / "stories260K.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    p.add_argument("--requests", type=int, default=200, help="shared-prefix: requests per arm")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix: shared prefix length")
    p.add_argument("--concurrency", type=int, default=4, help="shared-prefix: requests in flight")
    p.add_argument("--sessions", type=int, default=6, help="sessions: concurrent conversations")
    p.add_argument("--turns", type=int, default=8, help="sessions: turns per conversation")
    p.add_argument("--think-s", type=float, default=4.0, help="sessions: mean think time between turns")
    p.add_argument("--think-model", choices=["regular", "exponential"], default="regular",
                   help="sessions: regular = each session has its own mean think time (0.5-1.5 x --think-s)"
                        " and each gap is within +-jitter of it; exponential = memoryless gaps of mean --think-s"
                        " (nothing to predict)")
    p.add_argument("--think-jitter", type=float, default=0.2, help="sessions: relative spread of a regular session's gaps")
    p.add_argument("--memory-mb", type=float, default=64.0, help="sessions: the kvstore's memory tier")
    p.add_argument("--worker-blocks", type=int, default=192,
                   help="sessions: KV blocks in each worker's paged cache (pdserve up --num-blocks)")
    p.add_argument("--answer-tokens", type=int, default=16, help="sessions: tokens generated per turn")
    p.add_argument("--context-tokens", type=int, default=600,
                   help="sessions: a document of about this many tokens opens each session's first prompt")
    p.add_argument("--session-model", choices=[*MODEL_SHAPES, "stories260K"], default="llama-256x8",
                   help="sessions: a random Llama (MODEL_SHAPES) or the tiny bundled model")
    p.add_argument("--transfer-mb", type=float, default=256, help="transfer: KV bytes moved per arm")
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "/usr/bin/redis-server")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-batched-tokens", type=int, default=0,
                   help="sessions: engine step token budget of the workers (pdserve up --max-batched-tokens)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results = {}
    for name in scenarios:
        results[name] = {"shared-prefix": bench_shared_prefix, "sessions": bench_sessions,
                         "transfer": bench_transfer}[name](args)
    print(json.dumps(results, indent=2))
    print(format_table(results))
    return 0


# ---- helpers ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def with_env(env: dict[str, str], fn: Callable[[], object]) -> object:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def timed_generate(stub, prompt: str, max_tokens: int, session_id: str = "") -> dict:
    from pdserve.v1 import common_pb2, gateway_pb2

    start = time.perf_counter()
    ttft = None
    usage = None
    tokens: list[int] = []
    for chunk in stub.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, session_id=session_id,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - start
        tokens += chunk.token_ids
        if chunk.HasField("usage"):
            usage = chunk.usage
    return {"ttft_s": ttft, "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
            "tokens": tokens}


# ---- shared prefix ------------------------------------------------------------------------------


# Random Llamas the benchmark builds (stories260K's 512-token vocabulary and tokenizer):
#   llama-512x8: hidden 512, 8 layers, 8 heads of 64: prefill compute matters (32 KiB of KV per token)
#   llama-256x8: hidden 256, 8 layers, 8 heads of 64: the same 32 KiB of KV per token with a third
#     of the compute (a GPU computes a short turn far faster than it can move a long history)
#   llama-kv128k: hidden 256, 16 layers, 8 heads of 128, 8 KV heads: Llama-3-8B's KV per token
#     (128 KiB; fp32 here, fp16 there) with a CPU-sized compute, so moving a conversation's KV
#     costs what it costs on a GPU server relative to computing a few new tokens
MODEL_SHAPES = {
    "llama-512x8": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=8),
    "llama-256x8": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=8, head_dim=64),
    "llama-kv128k": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=16, num_attention_heads=8,
                         num_key_value_heads=8, head_dim=128),
}


def build_random_llama(folder: Path, seed: int, shape: str = "llama-512x8") -> Path:
    """A random Llama of `shape` (MODEL_SHAPES) saved as an HF directory with a tokenizer."""
    import torch
    import transformers

    from pdserve.runtime.hf_reader import GGUF_TOKENIZER_FILE

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=512, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                      **MODEL_SHAPES[shape])
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    from pdserve.runtime.loader import resolve_model_path

    source = STORIES_GGUF if STORIES_GGUF.exists() else Path(resolve_model_path(None))
    shutil.copy(source, folder / GGUF_TOKENIZER_FILE)
    return folder


def bench_shared_prefix(args: argparse.Namespace) -> dict:
    import concurrent.futures as cf

    from pdserve.runtime.loader import load_checkpoint
    from pdserve.stack import start_stack

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-") as tmp:
        model_dir = build_random_llama(Path(tmp) / "llama-512x8", args.seed)
        tok = load_checkpoint(str(model_dir)).tokenizer
        prefix_ids = [rng.randrange(3, 512) for _ in range(args.prefix_tokens)]
        words = ["cat", "dog", "sun", "tree", "ball", "park", "bird", "boat"]
        suffixes = [" " + " ".join(rng.choice(words) for _ in range(8)) for _ in range(args.requests)]
        shared = [tok.decode(prefix_ids) + s for s in suffixes]
        # Off: the same prompts, but a distinct first word makes every block unshareable.
        unshared = [f"{words[i % 8]}{i} " + tok.decode(prefix_ids) + s for i, s in enumerate(suffixes)]
        stack = start_stack(2, 1, "--model", str(model_dir), "--threads", str(args.threads))
        try:
            stub = stack.gateway_stub()
            timed_generate(stub, "warm up", 2)
            arms = {}
            for arm, prompts in (("caching_off", unshared), ("caching_on", shared)):
                start = time.perf_counter()
                with cf.ThreadPoolExecutor(args.concurrency) as pool:
                    runs = list(pool.map(lambda p: timed_generate(stub, p, 4), prompts))
                ttfts = [r["ttft_s"] for r in runs]
                arms[arm] = {"requests": len(runs), "seconds": round(time.perf_counter() - start, 2),
                             "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
                             "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
                             "cached_tokens_mean": round(statistics.mean(r["cached_tokens"] for r in runs), 1),
                             "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in runs), 1)}
        finally:
            stack.stop()
    return {"model": "random llama hidden 512, 8 layers (HF dir)", "prefix_tokens": args.prefix_tokens,
            "concurrency": args.concurrency, **arms}


# ---- sessions -----------------------------------------------------------------------------------


def bench_sessions(args: argparse.Namespace) -> dict:
    import redis

    redis_proc = RedisProcess(binary=args.redis_server).start()
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-") as tmp:
            model = str(STORIES_GGUF) if args.session_model == "stories260K" else str(
                build_random_llama(Path(tmp) / args.session_model, args.seed, args.session_model))
            arms = {}
            for arm, prefetch in (("prefetch_off", "0"), ("prefetch_on", "1")):
                arms[arm] = with_env({"PDSERVE_SESSION_PREFETCH": prefetch},
                                     lambda: _run_sessions(args, redis_proc.url, model))
                redis.Redis(port=redis_proc.port).flushall()
    finally:
        redis_proc.kill()
    return {"model": args.session_model, "sessions": args.sessions, "think_model": args.think_model,
            "think_jitter": args.think_jitter, "context_tokens": args.context_tokens,
            "answer_tokens": args.answer_tokens, "max_batched_tokens": args.max_batched_tokens or "default", "turns": args.turns, "think_s": args.think_s,
            "worker_blocks": args.worker_blocks, "memory_tier_mb": args.memory_mb, "kv_backend": "redis", **arms}


def think_times(args: argparse.Namespace, rng: random.Random) -> Callable[[], float]:
    """One session's think-time generator (see --think-model)."""
    if args.think_model == "exponential":
        return lambda: rng.expovariate(1 / args.think_s)
    mean = args.think_s * rng.uniform(0.5, 1.5)
    return lambda: mean * rng.uniform(1 - args.think_jitter, 1 + args.think_jitter)


STORY_WORDS = ("the cat dog sun tree ball park bird boat girl boy little big red happy sad ran saw "
               "played jumped went home with her his friend and then one day they were very").split()


def story_text(tok, rng: random.Random, tokens: int) -> str:
    """Sentences of common words, about `tokens` tokens long (words tokenize the same way each time)."""
    words: list[str] = []
    while len(tok.encode(" ".join(words), add_bos=False)) < tokens:
        words += [rng.choice(STORY_WORDS) for _ in range(8)] + ["."]
    return " ".join(words)


LOCAL_SOURCES = ("resident", "session", "hot", "dispatch")  # already on the worker when the request came


def scrape_counters(ports: list[int]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter sample of the workers on `ports`, summed: {(name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    total: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    total[key] = total.get(key, 0) + sample.value
    return total


def counter_delta(before: dict, after: dict, name: str, key: Callable[[dict[str, str]], str]) -> dict[str, float]:
    """Counter `name`'s growth between two scrapes, by `key(labels)`."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample == name:
            k = key(dict(labels))
            out[k] = out.get(k, 0) + value - before.get((sample, labels), 0)
    return out


def _free_port_run(n: int) -> int:
    """A base port with `n` free consecutive ports after it (best effort)."""
    from pdserve.ports import free_port, port_in_use

    for _ in range(50):
        base = free_port()
        if base + n < 65536 and all(port_in_use("127.0.0.1", base + i) is None for i in range(n)):
            return base
    raise RuntimeError("no run of free ports for the children's /metrics")


def _run_sessions(args: argparse.Namespace, redis_url: str, model: str | None) -> dict:
    import concurrent.futures as cf

    from gateway.prompts import tokenize_prompt
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path
    from pdserve.stack import start_stack

    tok = load_checkpoint(resolve_model_path(model)).tokenizer
    bs = 16
    metrics_base = _free_port_run(5)  # kvstore, prefill-0, decode-0, decode-1, gateway
    model_args = ("--model", model) if model else ()
    stack = start_stack(1, 2, *model_args, "--kvstore-capacity-mb", str(args.memory_mb), "--threads", str(args.threads),
                        "--num-blocks", str(args.worker_blocks), "--kv-backend", redis_url,
                        "--block-size", str(bs), "--metrics-port-base", str(metrics_base),
                        "--max-batched-tokens", str(args.max_batched_tokens))
    ports = {kind: [metrics_base + i for i, c in enumerate(stack.workers) if c.spec.name.startswith(kind)]
             for kind in ("prefill", "decode")}
    try:
        stub = stack.gateway_stub()
        timed_generate(stub, "warm up", 2)
        before = {kind: scrape_counters(ports[kind]) for kind in ports}
        openings = ["Once upon a time", "The little dog", "Lily and Tom", "A big red boat", "The sun was hot"]
        lines = ["and then they played.", "Tom said hello.", "The cat ran away.", "They were happy."]

        def conversation(i: int) -> list[dict]:
            r = random.Random(args.seed * 1000 + i)
            think = think_times(args, r)
            time.sleep(r.uniform(0, args.think_s))  # sessions start spread out
            text = f"{openings[i % len(openings)]} number {i} went to the park."
            if args.context_tokens:  # a document of the session's own, as a chat about a file would have
                text = story_text(tok, r, args.context_tokens) + " " + text
            prev_chain: list[int] = []  # the previous turn's prompt + answer (what its decode worker held)
            turns = []
            for t in range(args.turns):
                ids = tokenize_prompt(tok, text)
                out = timed_generate(stub, text, args.answer_tokens, session_id=f"s{i}")
                common = next((k for k, (a, b) in enumerate(zip(ids, prev_chain)) if a != b),
                              min(len(ids), len(prev_chain)))
                out.update(turn=t, prompt_blocks=len(ids) // bs, reusable_blocks=common // bs)
                turns.append(out)
                prev_chain = ids + out["tokens"][:-1]
                # The next turn: this prompt, its answer, and a new line (a chat's history).
                # Decoded with the history: the answer alone would lose its leading space, and
                # the next prompt would then diverge from this chain right at the answer.
                text = tok.decode(prev_chain + out["tokens"][-1:]) + " " + r.choice(lines)
                time.sleep(think())
            return turns

        start = time.perf_counter()
        with cf.ThreadPoolExecutor(args.sessions) as pool:
            runs = [t for conv in pool.map(conversation, range(args.sessions)) for t in conv]
        seconds = time.perf_counter() - start
        time.sleep(0.2)
        after = {kind: scrape_counters(ports[kind]) for kind in ports}
        src = {kind: counter_delta(before[kind], after[kind], f"pdserve_{kind}_blocks_total", lambda lb: lb["source"])
               for kind in ports}
        prefetch = {kind: counter_delta(before[kind], after[kind], "pdserve_prefetch_blocks_total",
                                        lambda lb: f"{lb['signal']}_{lb['outcome']}") for kind in ports}
        needed = sum(src["decode"].values())
        there = sum(src["decode"].get(k, 0) for k in LOCAL_SOURCES)
        prefill_reused = sum(src["prefill"].values())
        later = [r for r in runs if r["turn"] > 0]
        ttfts = [r["ttft_s"] for r in later]
        stats = stack.kvstore_stats()
        return {"seconds": round(seconds, 2), "requests": len(runs),
                "hit_rate": round(there / max(needed, 1), 3),
                "hit_rate_reusable": round(there / max(sum(r["reusable_blocks"] for r in later), 1), 3),
                "prefill_hit_rate": round(sum(src["prefill"].get(k, 0) for k in LOCAL_SOURCES)
                                          / max(prefill_reused, 1), 3),
                "ttft_p50_ms": round(1000 * percentile(ttfts, 50), 1),
                "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 1),
                # From the third turn on the session's own think time is known (the second turn
                # is predicted only from other sessions' gaps, when there were some).
                "ttft_p50_ms_turn3+": round(1000 * percentile([r["ttft_s"] for r in later if r["turn"] >= 2], 50), 1),
                "ttft_p99_ms_turn3+": round(1000 * percentile([r["ttft_s"] for r in later if r["turn"] >= 2], 99), 1),
                "decode_blocks": int(needed),
                **{f"blocks_{k}": int(src["decode"].get(k, 0)) for k in ("resident", "session", "dispatch", "late",
                                                                          "fetched", "missing")},
                "prefill_blocks": int(prefill_reused),
                **{f"prefill_blocks_{k}": int(src["prefill"].get(k, 0)) for k in ("resident", "session", "late",
                                                                                  "fetched", "missing")},
                "reusable_blocks": sum(r["reusable_blocks"] for r in later),
                "prefill_cached_frac": round(sum(r["cached_tokens"] for r in later)
                                             / max(sum(r["prompt_tokens"] for r in later), 1), 3),
                **{f"{kind}_prefetch_session_{o}": int(prefetch[kind].get(f"session_{o}", 0))
                   for kind in ports for o in ("hit", "late", "wasted")},
                "ttfts_ms_by_turn": [[r["turn"], round(1000 * r["ttft_s"], 1)] for r in later],
                "kvstore_evictions": stats.evictions, "redis_hits": stats.backend_hits,
                "redis_errors": stats.backend_errors}
    finally:
        stack.stop()


# ---- transfer -----------------------------------------------------------------------------------


def bench_transfer(args: argparse.Namespace) -> dict:
    import asyncio

    redis_proc = RedisProcess(binary=args.redis_server).start()
    try:
        return asyncio.run(_transfer(args, redis_proc))
    finally:
        redis_proc.kill()


async def _transfer(args: argparse.Namespace, redis_proc: RedisProcess) -> dict:
    import hashlib

    import redis.asyncio as aioredis
    import torch

    from kvstore.client import KVStoreClient
    from kvstore.config import KVStoreConfig
    from kvstore.server import serve_store
    from pdserve.grpc_server import stop_server
    from pdserve import kv_mac
    from pdserve.kvwire import encode_block
    from pdserve.runtime.kv_format import KVFormat

    # 64 KiB of KV per token: 16 layers x 2 (K, V) x 8 KV heads x 64 dims x fp32 = 64 KiB.
    spec = KVFormat("0" * 32, torch.float32, 16, 8, 64, 16)
    tensor = torch.randn(spec.shape)
    block = encode_block(tensor, spec, 16)  # 1 MiB + header per block
    n = max(int(args.transfer_mb * (1 << 20) // len(block)), 8)
    hashes = [hashlib.blake2b(f"t{i}".encode(), digest_size=16).digest() for i in range(n)]
    # Signed as workers sign them (each for its own hash), so the bytes moved are the real ones.
    key = kv_mac.key_from_env(os.environ) or kv_mac.generate_key().encode()
    start = time.perf_counter()
    signed = {h: encode_block(tensor, spec, 16, h, key) for h in hashes}
    encode_s = time.perf_counter() - start
    batch = 16  # blocks per call: one 256-token prompt
    total_mb = n * len(block) / 1e6

    config = KVStoreConfig(bind="127.0.0.1:0", capacity_bytes=4 * n * len(block), backend=redis_proc.url)
    server, port, store = await serve_store(config)
    client = KVStoreClient(f"127.0.0.1:{port}")
    start = time.perf_counter()
    for i in range(0, n, batch):
        await client.put_blocks(f"req{i}", [(h, signed[h]) for h in hashes[i:i + batch]])
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, batch):
        await client.get_blocks(hashes[i:i + batch], request_id=f"req{i}")
    get_s = time.perf_counter() - start
    await store.flush(timeout_s=60)
    await client.close()
    await stop_server(server, 0)
    await store.close()

    r = aioredis.Redis(port=redis_proc.port)
    await r.flushall()
    start = time.perf_counter()
    for i in range(0, n, batch):
        async with r.pipeline(transaction=False) as pipe:
            for h in hashes[i:i + batch]:
                pipe.set(b"raw:" + h, block)
            await pipe.execute()
    raw_set_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, n, batch):
        await r.mget([b"raw:" + h for h in hashes[i:i + batch]])
    raw_get_s = time.perf_counter() - start
    await r.aclose()
    return {"kv_bytes_per_token": 65536, "blocks": n, "block_bytes": len(block), "mb_moved": round(total_mb, 1),
            "signed_encode_mb_s": round(total_mb / encode_s, 1),  # copy + crc32 + HMAC-SHA256
            "kvstore_put_mb_s": round(total_mb / put_s, 1), "kvstore_get_mb_s": round(total_mb / get_s, 1),
            "redis_pipelined_set_mb_s": round(total_mb / raw_set_s, 1),
            "redis_mget_mb_s": round(total_mb / raw_get_s, 1)}


# ---- output -------------------------------------------------------------------------------------


def format_table(results: dict) -> str:
    lines = []
    for scenario, data in results.items():
        lines.append(f"== {scenario}")
        flat = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
        arms = {k: v for k, v in data.items() if isinstance(v, dict)}
        for k, v in flat.items():
            lines.append(f"  {k:<28} {v}")
        if arms:
            keys = [k for k, v in next(iter(arms.values())).items() if not isinstance(v, list)]
            lines.append("  " + f"{'':<20}" + "".join(f"{a:>16}" for a in arms))
            for k in keys:
                lines.append("  " + f"{k:<20}" + "".join(f"{str(arms[a].get(k)):>16}" for a in arms))
    return "\n".join(lines)
