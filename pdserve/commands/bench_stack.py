"""`pdserve bench-stack`: bench-engine's workload through a real disaggregated stack (its own
kvstore, prefill, decode and gateway processes) at a fixed concurrency, against the same
workload on the in-process engine at the same concurrency. Reports output tokens/s of both
and their ratio, TTFT P50/P99, and the KV bytes moved per request."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from pdserve.commands.output import write_json

NAME = "bench-stack"
HELP = "benchmark the disaggregated stack against the in-process engine on the same workload"


@dataclass
class RequestTiming:
    ttft_s: float
    latency_s: float
    output_tokens: int


@dataclass
class StackRun:
    name: str
    seconds: float
    timings: list[RequestTiming] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings)

    def summary(self) -> dict:
        ttft = sorted(t.ttft_s for t in self.timings)
        return {"name": self.name, "seconds": round(self.seconds, 3), "requests": len(self.timings),
                "output_tokens": self.output_tokens,
                "output_tokens_per_s": round(self.output_tokens / self.seconds, 1),
                "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
                "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_dtype_args, add_model_args

    add_model_args(p)
    add_dtype_args(p)  # both runs: the in-process engine as the stack's workers build theirs
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 40), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers in the stack")
    p.add_argument("--decode", type=int, default=1, help="decode workers in the stack")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stack process")
    p.add_argument("--engine-threads", type=int, default=None,
                   help="torch threads of the in-process engine (default: every core this process may use, "
                        "the machine the stack's processes share)")
    p.add_argument("--step-threads", type=int, default=0,
                   help="threads of the one-call C decode step, in both runs (0: each engine's torch threads of "
                        "the moment); with --engine-threads, a comparison thread for thread: the stack's other "
                        "processes then have the cores its decode worker leaves")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write results as JSON to this path ('-': stdout)")


def text_workload(tokenizer, vocab_size: int, args: argparse.Namespace) -> list[tuple[str, int]]:
    """(prompt text, output length) pairs; text so the gateway and the engine tokenize alike."""
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_requests):
        ids = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
        work.append((tokenizer.decode(ids) or "Once", rng.randint(*args.output_len)))
    return work


def run_in_process(engine, tokenizer, work: list[tuple[str, int]], concurrency: int) -> StackRun:
    """Closed loop at `concurrency`, like the stack's clients: a new request when one ends."""
    from pdserve.runtime.sampling_params import SamplingParams

    run, pending = StackRun("in-process", 0.0), list(enumerate(work))
    start_of: dict[str, float] = {}
    first_of: dict[str, float] = {}
    tokens_of: dict[str, int] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and len(start_of) < concurrency:
            i, (text, n) = pending.pop(0)
            engine.add_request(f"b{i}", tokenizer.encode(text),
                               SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            start_of[f"b{i}"] = time.perf_counter()
        for out in engine.step():
            rid, now = out.request_id, time.perf_counter()
            first_of.setdefault(rid, now)
            tokens_of[rid] = tokens_of.get(rid, 0) + len(out.new_token_ids)
            if out.finished:
                start = start_of.pop(rid)
                run.timings.append(RequestTiming(first_of.pop(rid) - start, now - start, tokens_of.pop(rid)))
    run.seconds = time.perf_counter() - t0
    return run


async def run_through_gateway(address: str, work: list[tuple[str, int]], concurrency: int) -> StackRun:
    import grpc

    from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    run, queue = StackRun("disaggregated", 0.0), asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def client() -> None:
            while not queue.empty():
                text, n = queue.get_nowait()
                request = gateway_pb2.GenerateRequest(prompt=text, sampling=common_pb2.SamplingParams(
                    max_tokens=n, temperature=0, ignore_eos=True))
                start, first, tokens = time.perf_counter(), None, 0
                async for chunk in stub.Generate(request):
                    if chunk.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += len(chunk.token_ids)
                run.timings.append(RequestTiming(first - start, time.perf_counter() - start, tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        run.seconds = time.perf_counter() - t0
    return run


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds used so far by each named process (Linux /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def kv_bytes_per_request(stack, num_requests: int) -> float:
    sent = sum(stack.worker_stats(c.spec.name).kv_bytes_sent for c in stack.workers
               if c.spec.name.startswith("prefill"))
    return sent / num_requests


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The model and dtype flags both runs share, as `pdserve up` flags."""
    flags = ["--dtype", args.dtype, "--weight-format", args.weight_format, "--dense-copy", args.dense_copy,
             "--int8-prompts", args.int8_prompts]
    flags += ["--kv-dtype", args.kv_dtype] if args.kv_dtype else []
    flags += ["--step-threads", str(args.step_threads)] if args.step_threads else []
    return flags + (["--model", args.model] if args.model else [])


def engine_threads(args: argparse.Namespace) -> int:
    """The in-process engine's threads: --engine-threads, else every core this process may use."""
    return args.engine_threads or len(os.sched_getaffinity(0))


def in_process_engine(args: argparse.Namespace):
    """(Engine, checkpoint) built from the engine flags' defaults and `engine_flags`, as a worker builds
    its own (pdserve.engine_args), on `engine_threads` threads."""
    from pdserve.engine_args import add_engine_args, build_engine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return build_engine(parser.parse_args([*engine_flags(args), "--threads", str(engine_threads(args))]))


def run(args: argparse.Namespace) -> int:
    from pdserve.stack import start_stack

    engine, checkpoint = in_process_engine(args)
    work = text_workload(checkpoint.tokenizer, checkpoint.config.vocab_size, args)
    local = run_in_process(engine, checkpoint.tokenizer, work, args.concurrency)
    del engine
    stack = start_stack(args.prefill, args.decode, "--threads", str(args.threads), *engine_flags(args))
    try:
        asyncio.run(run_through_gateway(stack.gateway_address, work[:4], 4))  # warm-up
        before = kv_bytes_per_request(stack, 1)
        pids = {c.spec.name: c.proc.pid for c in [*stack.workers, stack.gateway]} | {"client": os.getpid()}
        cpu_before = cpu_seconds(pids)
        remote = asyncio.run(run_through_gateway(stack.gateway_address, work, args.concurrency))
        cpu = {n: round(t - cpu_before.get(n, 0.0), 2) for n, t in cpu_seconds(pids).items()}
        kv_per_request = (kv_bytes_per_request(stack, 1) - before) / len(work)
    finally:
        stack.stop()
    return report([local, remote], kv_per_request, cpu, args)


def report(runs: list[StackRun], kv_per_request: float, cpu: dict[str, float], args: argparse.Namespace) -> int:
    rows = [r.summary() for r in runs]
    data = {"concurrency": args.concurrency, "prefill_workers": args.prefill, "decode_workers": args.decode,
            "stack_threads": args.threads, "engine_threads": engine_threads(args),
            "step_threads": args.step_threads,
            "runs": rows, "ratio": round(rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"], 2),
            "kv_bytes_per_request": round(kv_per_request), "cpu_seconds_during_run": cpu}
    print(f"{'run':<15}{'seconds':>9}{'out tok':>9}{'tok/s':>9}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for r in rows:
        print(f"{r['name']:<15}{r['seconds']:>9.2f}{r['output_tokens']:>9}{r['output_tokens_per_s']:>9.1f}"
              f"{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>13.1f}")
    print(f"disaggregated / in-process output tokens/s: {data['ratio']:.2f}x; "
          f"KV moved per request: {data['kv_bytes_per_request'] / 1024:.1f} KiB")
    print("CPU seconds during the disaggregated run: " + ", ".join(f"{n} {t:.1f}" for n, t in cpu.items()))
    if args.json:
        write_json(args.json, data)
    return 0
