"""`pdserve bench-overload`: offer a stack ten times what it can serve, with SLO-aware admission
and without, and report what the admitted requests saw and how fast the refused ones heard.

    pdserve bench-overload --overload 10 --duration 10 --json out.json

One stack (kvstore, prefill, decode workers) with two more gateways over the same workers: the
baseline gateway (only the in-flight cap, `--max-inflight`) and one with `--admission-ttft-slo-ms`,
each serving Prometheus metrics so that its own TTFT histogram can be read besides the client's.
Steps, in order:
  1. sustainable rate: a closed loop at --concurrency through the baseline gateway (completed
     requests per second while every client was busy); its TTFT P99 x 1.25 is the SLO unless
     --slo-ms gives one (a target the stack meets at full throughput);
  2. baseline: open-loop Poisson arrivals at --overload x that rate for --duration seconds, then
     every admitted request is waited for;
  3. admission: a second gateway with the SLO starts; a short closed loop at 4 clients per prefill
     worker lets it learn the prefill speed; then the same open loop.
Each run uses its own prompts (same lengths, another seed) so no run finds another's KV cached.

Per run: offered rate; admitted (completed) requests' TTFT P50/P99 and the share within the SLO;
refusals (RESOURCE_EXHAUSTED) and their latency P50/P99 (send to error, as the client saw it) and
retry-after hint; other failures by status; completed requests/s and output tokens/s over the run
(first arrival to last completion) and their ratio to the sustainable rate; goodput (completions
within the SLO per second).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.commands.output import write_json

NAME = "bench-overload"
HELP = "offer 10x the sustainable rate with and without SLO-aware admission: TTFT, rejection latency, throughput"

ADMISSION_ENV = "PDSERVE_ADMISSION_TTFT_SLO_MS"
LEARNING_CLIENTS_PER_WORKER = 4  # gateway.admission.AdmissionConfig.learning_queue


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled stories260K)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--slo-ms", type=float, default=0.0,
                   help="the TTFT SLO the admission gateway keeps (0: 1.25 x the TTFT P99 measured at the "
                        "sustainable rate)")
    p.add_argument("--overload", type=float, default=10.0, help="offered rate as a multiple of the sustainable one")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of open-loop arrivals per run")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients measuring the sustainable rate")
    p.add_argument("--calibrate-requests", type=int, default=96, help="requests of each closed loop")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (uniform within +-50%%)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (uniform within +-50%%)")
    p.add_argument("--max-inflight", type=int, default=256, help="both gateways' hard in-flight cap")
    p.add_argument("--timeout-s", type=float, default=60.0, help="deadline of each request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results as JSON to this path ('-': stdout)")


@dataclass(frozen=True, slots=True)
class Refusal:
    after_s: float  # send to error, as the client saw it
    retry_after_s: float | None  # the grpc-retry-pushback-ms hint, in seconds


class TimedGateway:
    """The bench client's gRPC backend, also timing failures (the client keeps no end time for
    them) and reading the retry-after hint of a refusal."""

    def __init__(self, address: str, timeout_s: float) -> None:
        from pdserve.bench.client import GrpcGateway

        self.inner = GrpcGateway(address, timeout_s)
        self.failures: dict[str, Refusal] = {}  # request id -> when and with what hint it failed

    async def stream(self, prompt: str, max_tokens: int, session_id: str, request_id: str) -> AsyncIterator[Any]:
        import grpc

        sent = time.perf_counter()
        try:
            async for chunk in self.inner.stream(prompt, max_tokens, session_id, request_id):
                yield chunk
        except grpc.aio.AioRpcError as err:
            trailers = dict(err.trailing_metadata() or ())
            pushback = trailers.get("grpc-retry-pushback-ms")
            self.failures[request_id] = Refusal(time.perf_counter() - sent,
                                                int(pushback) / 1000 if pushback else None)
            raise

    async def close(self) -> None:
        await self.inner.close()


def workload(tokenizer, n: int, args: argparse.Namespace, seed: int) -> list:
    from pdserve.bench.workloads import WorkloadSpec, build

    spec = WorkloadSpec(num_requests=n, input_len=args.input_len, output_len=args.output_len, range_ratio=0.5)
    return build(spec, tokenizer, seed)


async def run_load(address: str, conversations: Sequence, offsets: Sequence[float], label: str,
                   args: argparse.Namespace, concurrency: int | None = None, rate: float = math.inf,
                   run_id: str = "ovl") -> tuple[Any, list[Refusal]]:
    """Run the conversations; (the bench client's RunResult, the timing of each refusal)."""
    from pdserve.bench.client import run_workload

    backend = TimedGateway(address, args.timeout_s)
    try:
        run = await run_workload(backend, conversations, offsets, concurrency, label, request_rate=rate, run_id=run_id)
    finally:
        await backend.close()
    refused = [f"{run_id}-{r.conversation}-{r.turn}" for r in run.records if r.status == "RESOURCE_EXHAUSTED"]
    return run, [backend.failures[rid] for rid in refused if rid in backend.failures]


def closed_loop(address: str, tokenizer, args: argparse.Namespace, label: str, seed: int, slo_ms: float,
                concurrency: int) -> dict[str, Any]:
    """`concurrency` clients, each sending as soon as it is answered; `saturated_per_s` is the
    completion rate while every client was busy (see `saturated_rate`)."""
    conversations = workload(tokenizer, args.calibrate_requests, args, seed)
    run, refusals = asyncio.run(run_load(address, conversations, [0.0] * len(conversations), label, args,
                                         concurrency=concurrency, run_id=f"cal{seed}"))
    return summarize(run, refusals, slo_ms) | {"saturated_per_s": saturated_rate(run.records, concurrency)}


MIN_STEADY_WINDOW_S = 0.5


def saturated_rate(records: Sequence, concurrency: int) -> float:
    """Completions per second between the end of the first `concurrency` requests (the cold first
    round) and the last send (after it, clients run out of work and the rate falls)."""
    ok = [r for r in records if r.ok and r.latency is not None]
    if not ok:
        return 0.0
    last_send = max(r.start for r in records)
    ends = sorted(r.start + r.latency for r in ok)
    warm = ends[min(concurrency, len(ends)) - 1]  # the cold first round is over
    window = last_send - warm
    done = sum(1 for e in ends if warm < e <= last_send)
    # Completions over the window's length, not over the spread of the completions themselves:
    # two requests ending a microsecond apart are not a rate of a million per second.
    if window < MIN_STEADY_WINDOW_S or done < 2:  # too short to see a steady state: the whole run
        first = min(r.start for r in records)
        return round(len(ok) / max(ends[-1] - first, 1e-3), 2)
    return round(done / window, 2)


def open_loop(gateway: Gateway, tokenizer, rate: float, args: argparse.Namespace, label: str, seed: int,
              slo_ms: float) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `--duration` seconds; waits for every admitted request. Also
    the TTFT the gateway measured (from the request reaching its handler): the client's TTFT less
    the time the request waited in the client and in the gateway before it was even read."""
    from pdserve.bench.arrivals import start_offsets

    n = max(1, round(rate * args.duration))
    conversations = workload(tokenizer, n, args, seed)
    offsets = start_offsets(n, rate, seed=seed)
    before = ttft_buckets(gateway)
    run, refusals = asyncio.run(run_load(gateway.address, conversations, offsets, label, args, rate=rate,
                                         run_id=f"open{seed}"))
    after = ttft_buckets(gateway)
    return summarize(run, refusals, slo_ms) | {
        "offered_rate": round(rate, 2), "offered": n,
        "gateway_ttft_p50_ms": histogram_quantile(0.5, before, after),
        "gateway_ttft_p99_ms": histogram_quantile(0.99, before, after)}


def _ms(values: Sequence[float], q: float) -> float | None:
    import numpy as np

    return round(float(np.percentile(np.asarray(values) * 1000, q)), 1) if len(values) else None


def summarize(run, refusals: Sequence[Refusal], slo_ms: float) -> dict[str, Any]:
    """The numbers of one run (see the module docstring)."""
    from collections import Counter

    ok = [r for r in run.records if r.ok]
    refused = [r for r in run.records if r.status == "RESOURCE_EXHAUSTED"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    within = sum(t * 1000 <= slo_ms for t in ttft)
    seconds = run.duration_s or math.nan
    tokens = sum(r.output_tokens for r in ok)
    return {
        "label": run.label, "requests": len(run.records), "completed": len(ok), "refused": len(refused),
        "other_errors": dict(Counter(r.status for r in run.records if not r.ok and r.status != "RESOURCE_EXHAUSTED")),
        "seconds": round(run.duration_s, 2),
        "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
        "within_slo": round(within / len(ttft), 3) if ttft else None,
        "refusal_p50_ms": _ms([f.after_s for f in refusals], 50),
        "refusal_p99_ms": _ms([f.after_s for f in refusals], 99),
        "retry_after_p50_ms": _ms([f.retry_after_s for f in refusals if f.retry_after_s is not None], 50),
        "completed_per_s": round(len(ok) / seconds, 2), "output_tokens_per_s": round(tokens / seconds, 1),
        "goodput_per_s": round(within / seconds, 2),
    }


@dataclass(frozen=True, slots=True)
class Gateway:
    address: str
    metrics_port: int  # its Prometheus /metrics, for the TTFT it measured itself


def start_gateway(stack, name: str, *flags: str) -> Gateway:
    """Another gateway over the stack's workers (with `flags`), serving /metrics on a port of its own."""
    from pdserve.ports import free_port

    spec = stack.gateway.spec
    address, metrics_port = f"{spec.address.rsplit(':', 1)[0]}:{free_port()}", free_port()
    command = list(spec.command)
    command[command.index("--bind") + 1] = address
    command += [*flags, "--http-port", "0"]
    child = stack.supervisor.start(replace(spec, name=name, address=address, command=tuple(command),
                                           env=(*spec.env, ("PDSERVE_METRICS_PORT", str(metrics_port)))))
    if not stack.supervisor.wait_serving([child], timeout_s=180):
        raise RuntimeError(f"{name} did not start:\n" + child.last_output())
    return Gateway(address, metrics_port)


def ttft_buckets(gateway: Gateway) -> dict[float, float]:
    """The gateway's pdserve_ttft_seconds histogram: upper bound -> cumulative count."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=10).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "pdserve_ttft_seconds")
    return {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile (0..1) of what a cumulative histogram gained between two scrapes, in ms,
    interpolated linearly within its bucket (as Prometheus' histogram_quantile)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if math.isinf(bound):
                return round(lower * 1000, 1)
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return round((lower + (bound - lower) * share) * 1000, 1)
        lower, below = bound, cumulative
    return None


def auto_slo_ms(sustainable: dict[str, Any]) -> float:
    """The SLO when none is given: 1.25 x the TTFT P99 the stack had at its sustainable rate (a
    target it can meet at full throughput, so that refusing is only needed past it)."""
    return round(1.25 * (sustainable["ttft_p99_ms"] or 100.0))


def warm_up(address: str, tokenizer, args: argparse.Namespace) -> None:
    """First calls through a gateway (channels, model code paths), not measured."""
    asyncio.run(run_load(address, workload(tokenizer, 4, args, args.seed), [0.0] * 4, "warm-up", args,
                         concurrency=2, run_id="warm"))


def run(args: argparse.Namespace) -> int:
    from pdserve.runtime.loader import inspect_checkpoint, resolve_model_path
    from pdserve.stack import start_stack

    if args.overload <= 1 or args.duration <= 0 or args.slo_ms < 0:
        raise SystemExit("bench-overload: need --overload > 1, --duration > 0 and --slo-ms >= 0")
    tokenizer = inspect_checkpoint(resolve_model_path(args.model)).tokenizer
    os.environ.pop(ADMISSION_ENV, None)  # the baseline gateway must run without admission
    extra = ["--model", args.model] if args.model else []
    stack = start_stack(args.prefill, args.decode, "--threads", str(args.threads),
                        "--max-inflight", str(args.max_inflight), *extra)
    try:
        base = start_gateway(stack, "gateway-baseline")
        warm_up(base.address, tokenizer, args)
        sustainable = closed_loop(base.address, tokenizer, args, "sustainable", args.seed + 1, args.slo_ms or math.inf,
                                  args.concurrency)
        slo_ms = args.slo_ms or auto_slo_ms(sustainable)
        if not args.slo_ms:  # measured before there was an SLO
            sustainable.pop("within_slo"), sustainable.pop("goodput_per_s")
        rate = args.overload * sustainable["saturated_per_s"]
        baseline = open_loop(base, tokenizer, rate, args, "admission off", args.seed + 2, slo_ms)
        adm = start_gateway(stack, "gateway-admission", "--admission-ttft-slo-ms", str(slo_ms))
        warm_up(adm.address, tokenizer, args)
        # Learning admits a few requests per prefill worker: more clients would only be refused.
        learning = closed_loop(adm.address, tokenizer, args, "admission warm-up", args.seed + 3, slo_ms,
                               min(args.concurrency, LEARNING_CLIENTS_PER_WORKER * args.prefill))
        admitted = open_loop(adm, tokenizer, rate, args, "admission on", args.seed + 4, slo_ms)
    finally:
        stack.stop()
    return report(sustainable, learning, [baseline, admitted], slo_ms, args)


def report(sustainable: dict, learning: dict, runs: list[dict], slo_ms: float, args: argparse.Namespace) -> int:
    rate = sustainable["saturated_per_s"]
    for r in runs:
        r["throughput_vs_sustainable"] = round(r["completed_per_s"] / rate, 2) if rate else None
    data = {"slo_ms": slo_ms, "slo_from": "--slo-ms" if args.slo_ms else "1.25 x sustainable TTFT P99", "overload": args.overload, "duration_s": args.duration,
            "prefill_workers": args.prefill, "decode_workers": args.decode,
            "sustainable": sustainable, "admission_warmup": learning, "runs": runs}
    print(f"sustainable (closed loop, {args.concurrency} clients): {rate:.2f} req/s, "
          f"{sustainable['output_tokens_per_s']:.1f} tok/s, TTFT p99 {sustainable['ttft_p99_ms']} ms; "
          f"offered {args.overload:g}x = {runs[0]['offered_rate']:.1f} req/s for {args.duration:g} s; SLO {slo_ms:g} ms")
    head = ("run", "offered", "done", "refused", "other", "TTFT p50", "TTFT p99", "gw p50", "gw p99", "in SLO",
            "refuse p50", "refuse p99", "req/s", "tok/s", "vs sust.")
    print("".join(f"{h:>11}" if i else f"{h:<15}" for i, h in enumerate(head)))
    for r in runs:
        cells = (r["offered"], r["completed"], r["refused"], sum(r["other_errors"].values()),
                 _cell(r["ttft_p50_ms"]), _cell(r["ttft_p99_ms"]), _cell(r["gateway_ttft_p50_ms"]),
                 _cell(r["gateway_ttft_p99_ms"]), _cell(r["within_slo"]),
                 _cell(r["refusal_p50_ms"]), _cell(r["refusal_p99_ms"]), r["completed_per_s"],
                 r["output_tokens_per_s"], _cell(r["throughput_vs_sustainable"]))
        print(f"{r['label']:<15}" + "".join(f"{c:>11}" for c in cells))
    print("(ms; TTFT as the client saw it, 'gw': as the gateway measured it from its handler; 'in SLO': "
          "share of completed requests with client TTFT within the SLO; 'vs sust.': completed req/s over "
          "the sustainable rate)")
    if args.json:
        write_json(args.json, data)
    return 0


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)
