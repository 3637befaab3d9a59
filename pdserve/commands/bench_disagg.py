"""`pdserve bench-disagg`: what conditional disaggregation buys on a mixed workload, measured on a
real stack (1 prefill worker, --decode decode workers, the kvstore and the gateway).

The workload: --requests one-turn requests, a --short-frac share of short prompts (--short tokens,
e.g. 8-32) and the rest long (--long, e.g. 500-1000), arriving open-loop as a Poisson process.
The model is a random Llama (hidden 512, 8 layers; `bench_kv.build_random_llama`), heavy enough
that prefill compute matters, unless --model names one.

Each arm (--arms, default always-remote then conditional) gets its own stack with the gateway's
--disagg-policy, all up at once, and runs the same requests at the same arrival times: the
workload is cut into --rounds slices, and each slice runs on every arm in turn (who goes first
alternates), so that the other load of a shared machine falls on every arm alike. The stacks
stay idle while another arm runs; each slice starts on an empty system. The request rate is --rate,
or with --rate 0 (the default) --load times the always-remote capacity measured first on an idle
stack: 1 / (short share * TTFT of a short prompt + long share * TTFT of a long one). That
calibration also gives the conditional policy its --disagg-prefill-ms-per-token (the slope of TTFT
over prompt length).

Per arm: TTFT P50/P99 and TPOT P50 of short, long and all requests, request throughput, and where
the prompts were prefilled (remote = the prefill worker's prefills, from its Stats); then each
arm's ratio to the first. One JSON object (stdout, or --json PATH) and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

NAME = "bench-disagg"
HELP = "benchmark conditional disaggregation (local vs remote prefill) on a mixed short/long workload"

CLASSES = ("short", "long")


def token_range(text: str) -> tuple[int, int]:
    """"8-32" -> (8, 32)."""
    lo, sep, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token range MIN-MAX like 8-32, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX in MIN-MAX, got {text!r}")
    return bounds


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gateway.disagg import POLICIES, DisaggConfig

    p.add_argument("--requests", type=int, default=150, help="requests per arm")
    p.add_argument("--short-frac", type=float, default=0.8, help="share of short prompts")
    p.add_argument("--short", type=token_range, default=(8, 32), metavar="MIN-MAX", help="short prompt tokens")
    p.add_argument("--long", type=token_range, default=(500, 1000), metavar="MIN-MAX", help="long prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--rate", type=float, default=0.0,
                   help="requests per second (Poisson); 0: --load times the measured always-remote capacity")
    p.add_argument("--load", type=float, default=0.9, help="with --rate 0: the fraction of capacity to offer")
    p.add_argument("--arms", default="always-remote,conditional",
                   help=f"policies to compare, comma-separated, the first is the baseline ({', '.join(POLICIES)})")
    p.add_argument("--rounds", type=int, default=4,
                   help="slices of the workload; each runs on every arm in turn (alternating who goes "
                        "first), so a busy spell of the machine hits every arm alike")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--local-prefill-max-tokens", type=int, default=DisaggConfig().local_max_tokens,
                   help="the conditional arm's threshold (gateway flag of the same name)")
    p.add_argument("--model", default=None, help="checkpoint (default: a random Llama built in a temp folder)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="-", metavar="PATH", help="where the JSON goes ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from gateway.disagg import POLICIES
    from pdserve.commands.output import write_json

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in POLICIES]
    if not arms or bad or args.requests < 1 or args.rounds < 1 or not 0 <= args.short_frac <= 1:
        print(f"pdserve bench-disagg: --arms takes {', '.join(POLICIES)} (got {args.arms!r}); --requests and --rounds >= 1; "
              "--short-frac in [0, 1]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-disagg-") as tmp:
        model = args.model or str(_random_model(Path(tmp), args.seed))
        results = bench(args, arms, model)
    write_json(args.json, results)
    print(format_table(results))
    return 0


def _random_model(folder: Path, seed: int) -> Path:
    from pdserve.commands.bench_kv import build_random_llama

    return build_random_llama(folder / "llama-512x8", seed)


# ---- the workload --------------------------------------------------------------------------------


def mixed_workload(args: argparse.Namespace, tokenizer) -> list:
    """One-turn conversations "short-i" / "long-i" (shuffled by the seed)."""
    from pdserve.bench.workloads import Conversation, Turn, random_text

    rng = random.Random(args.seed)
    out = []
    for i in range(args.requests):
        cls = "short" if rng.random() < args.short_frac else "long"
        lo, hi = args.short if cls == "short" else args.long
        out.append(Conversation(f"{cls}-{i}", (Turn(random_text(tokenizer, rng, rng.randint(lo, hi)),
                                                     args.max_tokens),)))
    return out


# ---- one arm --------------------------------------------------------------------------------------


def bench(args: argparse.Namespace, arms: list[str], model: str) -> dict[str, Any]:
    from pdserve.bench.arrivals import start_offsets
    from pdserve.bench.client import RunResult
    from pdserve.runtime.loader import load_checkpoint

    conversations = mixed_workload(args, load_checkpoint(model).tokenizer)
    shorts = sum(c.id.startswith("short") for c in conversations)
    results: dict[str, Any] = {
        "model": args.model or "random llama hidden 512, 8 layers (HF dir)", "requests": args.requests,
        "short_requests": shorts, "long_requests": args.requests - shorts, "short_tokens": list(args.short),
        "long_tokens": list(args.long), "max_tokens": args.max_tokens, "decode_workers": args.decode,
        "local_prefill_max_tokens": args.local_prefill_max_tokens, "rounds": args.rounds, "arms": {}}
    stacks: dict[str, Any] = {}
    try:
        stacks[arms[0]] = _start(args, model, arms[0], None)
        calibration = calibrate(stacks[arms[0]], args)
        rate = args.rate or args.load * calibration["capacity_rps"]
        results.update(calibration=calibration, rate_rps=round(rate, 3))
        for arm in arms[1:]:
            stacks[arm] = _start(args, model, arm, calibration["prefill_ms_per_token"])
        offsets = start_offsets(len(conversations), rate, seed=args.seed)
        records: dict[str, list] = {arm: [] for arm in arms}
        seconds = dict.fromkeys(arms, 0.0)
        remote = dict.fromkeys(arms, 0)
        for k, (convs, offs) in enumerate(rounds(conversations, offsets, args.rounds)):
            for arm in arms if k % 2 == 0 else arms[::-1]:  # alternate who goes first
                result, prefills = run_round(stacks[arm], convs, offs, f"{arm}-{k}")
                records[arm] += result.records
                seconds[arm] += result.duration_s
                remote[arm] += prefills
        for arm in arms:
            results["arms"][arm] = summarize_arm(RunResult(arm, records[arm], seconds[arm]), remote[arm])
    finally:
        for stack in stacks.values():
            stack.stop()
    results["ratios"] = ratios(results["arms"])
    return results


def rounds(conversations: list, offsets: list[float], n: int) -> list[tuple[list, list[float]]]:
    """The workload cut into `n` consecutive slices, each slice's arrivals starting at 0."""
    size = -(-len(conversations) // max(n, 1))
    out = []
    for i in range(0, len(conversations), size):
        offs = offsets[i:i + size]
        out.append((conversations[i:i + size], [o - offs[0] for o in offs]))
    return out


def _start(args: argparse.Namespace, model: str, policy: str, prefill_ms_per_token: float | None):
    from pdserve.stack import start_stack

    flags = ["--disagg-policy", policy, "--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    if prefill_ms_per_token is not None:
        flags += ["--disagg-prefill-ms-per-token", str(prefill_ms_per_token)]
    return start_stack(1, args.decode, "--model", model, "--threads", str(args.threads), *flags)


def calibrate(stack, args: argparse.Namespace, reps: int = 3) -> dict[str, float]:
    """Idle TTFT of a short and a long prompt (median of `reps`, after a warm-up); the capacity
    and per-token slope derived from them."""
    from pdserve.commands.bench_kv import timed_generate
    from pdserve.runtime.loader import load_checkpoint
    from pdserve.bench.workloads import random_text

    stub = stack.gateway_stub()
    tok = load_checkpoint(stack.args.model).tokenizer
    rng = random.Random(args.seed + 1)
    timed_generate(stub, "warm up", 2)
    n_short, n_long = sum(args.short) // 2, sum(args.long) // 2

    def median_ttft(n: int) -> tuple[float, int]:
        runs = [timed_generate(stub, random_text(tok, rng, n), 1) for _ in range(reps)]
        return statistics.median(r["ttft_s"] for r in runs), round(statistics.mean(r["prompt_tokens"] for r in runs))

    short_s, short_tokens = median_ttft(n_short)
    long_s, long_tokens = median_ttft(n_long)
    per_request = args.short_frac * short_s + (1 - args.short_frac) * long_s
    slope = max(long_s - short_s, 1e-6) / max(long_tokens - short_tokens, 1)
    return {"short_tokens": short_tokens, "short_ttft_ms": round(short_s * 1e3, 1), "long_tokens": long_tokens,
            "long_ttft_ms": round(long_s * 1e3, 1), "capacity_rps": round(1 / per_request, 3),
            # At least 0.0001: the gateway refuses 0, which rounding gave when a tiny model's long
            # prompt was not slower than its short one (overhead, not compute, sets its TTFT).
            "prefill_ms_per_token": max(round(slope * 1e3, 4), 0.0001)}


def run_round(stack, conversations: list, offsets: list[float], run_id: str) -> tuple[Any, int]:
    """(RunResult, prefills the prefill worker ran) of one slice of the workload on one stack."""
    from pdserve.bench.client import GrpcGateway, run_workload

    async def go():
        backend = GrpcGateway(stack.gateway_address)
        try:
            return await run_workload(backend, conversations, offsets, label=run_id,
                                      run_id=f"{run_id}-{time.time():.0f}")
        finally:
            await backend.close()

    before = stack.worker_stats("prefill-0").tokens_generated
    result = asyncio.run(go())
    return result, stack.worker_stats("prefill-0").tokens_generated - before  # one first token per prefill


def summarize_arm(result, remote_prefills: int) -> dict[str, Any]:
    """TTFT P50/P99 and TPOT P50 (ms) per class and overall, throughput, placements."""
    from pdserve.bench.report import distribution_ms, request_tpot

    ok = [r for r in result.records if r.ok]
    errors = Counter(r.status for r in result.records if not r.ok)
    out: dict[str, Any] = {"completed": len(ok), "failed": len(result.records) - len(ok), "errors": dict(errors),
                           "seconds": round(result.duration_s, 2),
                           "requests_per_s": round(len(ok) / result.duration_s, 3),
                           "prefilled_remote": remote_prefills, "prefilled_local": len(ok) - remote_prefills}
    for cls in (*CLASSES, "all"):
        mine = [r for r in ok if cls == "all" or r.conversation.startswith(cls)]
        ttft = distribution_ms([r.ttft for r in mine if r.ttft is not None])
        tpot = distribution_ms([t for t in map(request_tpot, mine) if t is not None])
        out[cls] = {"ttft_p50_ms": _round(ttft["p50"]), "ttft_p99_ms": _round(ttft["p99"]),
                    "tpot_p50_ms": _round(tpot["p50"])}
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each later arm's latencies and throughput over the first arm's (< 1: lower than baseline)."""
    names = list(arms)
    base = arms[names[0]]
    out = {}
    for name in names[1:]:
        arm = arms[name]
        row: dict[str, float | None] = {"requests_per_s": _ratio(arm["requests_per_s"], base["requests_per_s"])}
        for cls in (*CLASSES, "all"):
            for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms"):
                row[f"{cls}_{key}"] = _ratio(arm[cls][key], base[cls][key])
        out[f"{name}/{names[0]}"] = row
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


# ---- output -------------------------------------------------------------------------------------


def format_table(results: dict[str, Any]) -> str:
    arms = results["arms"]
    names = list(arms)
    cal = results.get("calibration", {})
    lines = [f"rate {results.get('rate_rps')} req/s, {results['short_requests']} short "
             f"{results['short_tokens']} + {results['long_requests']} long {results['long_tokens']} prompt tokens, "
             f"{results['max_tokens']} output tokens; idle TTFT short {cal.get('short_ttft_ms')} ms, "
             f"long {cal.get('long_ttft_ms')} ms"]
    later = [f"{n}/{names[0]}" for n in names[1:]]
    short_name = lambda n: n.split("-")[-1]  # noqa: E731 - "conditional/remote"
    header = (f"{'':<22}" + "".join(f"{n:>16}" for n in names)
              + "".join(f"{short_name(n) + '/' + short_name(names[0]):>20}" for n in names[1:]))
    lines.append(header)
    rows = [("requests/s", None, "requests_per_s"), ("failed", None, "failed"),
            ("prefilled remote", None, "prefilled_remote"),
            ("prefilled local", None, "prefilled_local")]
    rows += [(f"{cls} {key[:-3].replace('_', ' ')} ms", cls, key) for cls in ("short", "long", "all")
             for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")]
    for label, cls, key in rows:
        values = [arms[n][cls][key] if cls else arms[n][key] for n in names]
        ratio_values = [results["ratios"][r].get(f"{cls}_{key}" if cls else key) for r in later]
        lines.append(f"{label:<22}" + "".join(f"{str(v):>16}" for v in values)
                     + "".join(f"{str(r) if r is not None else '':>20}" for r in ratio_values))
    return "\n".join(lines)
