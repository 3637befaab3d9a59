"""`pdserve bench`: drive a running gateway with a workload and report serving metrics.

    pdserve bench --server 127.0.0.1:50051 --workload random --num-requests 200 --request-rate 8
    pdserve bench --start-stack --workload sessions --turns 4 --sweep 2,4,8,inf --baseline hf \
        --json out.json --plot out.png
    pdserve bench --openai-url http://127.0.0.1:8080 --model MODEL.gguf --max-concurrency 8

--openai-url drives any OpenAI-compatible server (llama.cpp server, vLLM, SGLang, pdserve's HTTP
API) through streaming /v1/completions with the same workload (pdserve.bench.openai_client).

Workloads (pdserve.bench.workloads): random, shared-prefix, sessions, file (ShareGPT JSON).
Arrivals: Poisson at --request-rate (gamma with --burstiness), or everything at once (rate inf)
capped at --max-concurrency (a closed loop); --sweep runs the same requests at several rates.
Requests are greedy, or sample as a chat client does with --temperature (and --top-p, --top-k,
--min-p), each seeded (pdserve.bench.sampling).
Reports request/output/total-token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, P50,
P90, P99), goodput under --slo-ttft-ms/--slo-tpot-ms and errors by status; --baseline hf runs the
same requests through transformers generate() in this process and prints ratios beside.

The served model must be the one given by --model (default: $PDSERVE_MODEL, else stories260K):
its tokenizer builds the prompts, and the baseline runs its weights. Imports stay inside `run` so
that `pdserve --help` does not load torch.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.sampling import RequestSampling
from pdserve.commands.output import write_json

NAME = "bench"
HELP = "benchmark a running gateway: throughput, TTFT/TPOT/ITL/e2e percentiles, goodput, vs transformers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--server", default=None, metavar="HOST:PORT", help="the gateway's gRPC address")
    target.add_argument("--openai-url", default=None, metavar="URL",
                        help="instead: any OpenAI-compatible server (llama.cpp server, vLLM, pdserve's HTTP API), "
                             "through streaming /v1/completions")
    target.add_argument("--openai-model", default="", help="with --openai-url: the model id to send "
                                                           "(default: the first of GET /v1/models)")
    target.add_argument("--openai-api-key", default="", help="with --openai-url: a bearer token, if it wants one")
    target.add_argument("--openai-endpoint", default="completions", choices=["completions", "chat"],
                        help="with --openai-url: /v1/completions (the prompt as text), or /v1/chat/completions "
                             "(the prompt as one user message, the chat template applied by the server)")
    target.add_argument("--start-stack", action="store_true",
                        help="without --server: start kvstore, prefill, decode and gateway here for the run")
    target.add_argument("--prefill", type=int, default=1, help="prefill workers of --start-stack")
    target.add_argument("--decode", type=int, default=1, help="decode workers of --start-stack")
    target.add_argument("--threads", type=int, default=1,
                        help="torch threads per process of --start-stack (and of the baseline when "
                             "--baseline-threads is 0)")
    target.add_argument("--model", default=None,
                        help="the served model (tokenizer for the prompts, weights for the baseline); "
                             "default: $PDSERVE_MODEL, else the bundled stories260K")
    target.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each request")

    work = p.add_argument_group("workload")
    work.add_argument("--workload", default="random", choices=["random", "shared-prefix", "sessions", "file"])
    work.add_argument("--num-requests", type=int, default=100, help="requests in all (sessions: all turns)")
    work.add_argument("--input-len", type=int, default=32, help="prompt tokens (shared-prefix: the suffix; "
                                                                "sessions: the first turn)")
    work.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    work.add_argument("--range-ratio", type=float, default=0.5,
                      help="lengths are uniform in [len*(1-r), len*(1+r)]")
    work.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    work.add_argument("--prefix-len", type=int, default=64, help="shared-prefix: tokens per prefix")
    work.add_argument("--turns", type=int, default=3, help="sessions: turns per conversation")
    work.add_argument("--turn-len", type=int, default=16, help="sessions: user tokens added per turn")
    work.add_argument("--think-time-ms", type=float, default=200.0, help="sessions: pause between turns")
    work.add_argument("--dataset", default=None, metavar="PATH", help="file: ShareGPT-style JSON")
    work.add_argument("--seed", type=int, default=0, help="the workload's, and the sampled requests' seeds")
    work.add_argument("--temperature", type=float, default=0.0,
                      help="0 (default): greedy; else every request samples at this temperature, seeded, "
                           "with --top-p, --top-k and --min-p (sent at their off values too)")
    work.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass")
    work.add_argument("--top-k", type=int, default=0, help="with --temperature: most likely tokens kept (0: all)")
    work.add_argument("--min-p", type=float, default=0.0, help="with --temperature: min-p (0: off)")

    load = p.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests (sessions: conversations) per second, Poisson; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="cap on requests in flight (with rate inf: a closed loop)")
    load.add_argument("--sweep", default=None, metavar="R1,R2,...",
                      help="run once per request rate (e.g. 1,2,4,inf) instead of --request-rate")
    load.add_argument("--warmup", type=int, default=2, help="requests sent (and not counted) first")

    out = p.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=250.0, help="goodput: TTFT at most this")
    out.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput: TPOT at most this")
    out.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-': stdout)")
    out.add_argument("--plot", default=None, metavar="PATH.png", help="latency CDFs (and a sweep's curves)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--baseline", default="none", choices=["none", "hf"],
                     help="hf: the same requests through transformers generate() in this process")
    out.add_argument("--baseline-batch-size", type=int, default=32, help="static batch of the baseline")
    out.add_argument("--baseline-threads", type=int, default=0,
                     help="torch threads of the baseline (0: --threads, like each stack process; more "
                          "threads than idle cores make torch's CPU kernels spin and crawl)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError) as err:
        print(f"pdserve bench: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.bench import arrivals, report, workloads
    from pdserve.bench.client import RunResult, run_workload
    from pdserve.bench.progress import ProgressBar
    from pdserve.runtime.loader import inspect_checkpoint, load_checkpoint, resolve_model_path

    if args.server is None and args.openai_url is None and not args.start_stack:
        raise ValueError("give --server HOST:PORT (a running gateway), --openai-url URL or --start-stack")
    rates = arrivals.parse_rates(args.sweep) if args.sweep else [args.request_rate]
    sampling = _sampling(args)  # checked before anything starts
    model_path = resolve_model_path(args.model)
    tokenizer = inspect_checkpoint(model_path).tokenizer  # the weights only for a baseline (at its turn)
    spec = workloads.WorkloadSpec(
        args.workload, args.num_requests, args.input_len, args.output_len, args.range_ratio, args.num_prefixes,
        args.prefix_len, args.turns, args.turn_len, args.think_time_ms / 1000, args.dataset)
    conversations = workloads.build(spec, tokenizer, args.seed)
    total = workloads.num_requests(conversations)
    slo = report.Slo(args.slo_ttft_ms, args.slo_tpot_ms)

    stack = None
    address = args.server
    if address is None and args.openai_url is None:
        from pdserve.stack import start_stack

        print(f"pdserve bench: starting a stack ({args.prefill} prefill, {args.decode} decode)", file=sys.stderr)
        extra = [*(["--model", args.model] if args.model else []), "--threads", str(args.threads)]
        stack = start_stack(args.prefill, args.decode, *extra)
        address = stack.gateway_address
    runs: list[RunResult] = []
    try:
        for i, rate in enumerate(rates):
            offsets = arrivals.start_offsets(len(conversations), rate, args.burstiness, args.seed)
            name = "pdserve" if args.openai_url is None else "openai"
            label = name if len(rates) == 1 else f"{name}@{rate:g}"
            progress = ProgressBar(total, label, enabled=not args.no_progress)

            async def one_run() -> RunResult:
                backend = _backend(args, address, sampling)
                try:
                    if args.warmup:
                        warm = workloads.build(workloads.WorkloadSpec(
                            "random", args.warmup, args.input_len, min(args.output_len, 16)), tokenizer,
                            args.seed + 1)
                        await run_workload(backend, warm, [0.0] * len(warm), run_id=f"warm{i}")
                    return await run_workload(backend, conversations, offsets, args.max_concurrency, label,
                                              on_record=lambda r: progress.update(r.ok), request_rate=rate,
                                              run_id=f"bench{i}")
                finally:
                    await backend.close()
            runs.append(asyncio.run(one_run()))
            progress.close()
    finally:
        if stack is not None:
            stack.stop()

    baseline = None
    if args.baseline == "hf":
        import torch

        from pdserve.bench.baseline import run_hf

        torch.set_num_threads(args.baseline_threads or args.threads)
        progress = ProgressBar(total, "transformers", enabled=not args.no_progress)
        baseline = run_hf(load_checkpoint(model_path), conversations, args.baseline_batch_size,
                          on_record=lambda r: progress.update(r.ok))
        progress.close()

    summaries = [report.summarize(r, slo) for r in runs]
    base_summary = report.summarize(baseline, slo) if baseline else None
    print(f"workload {args.workload}: {total} requests in {len(conversations)} conversations, "
          f"burstiness {args.burstiness:g}, max concurrency {args.max_concurrency or 'none'}")
    if len(runs) > 1:
        print(report.format_sweep(summaries))
        print()
    print(report.format_comparison(summaries, base_summary))
    if args.json:
        data = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                "runs": summaries, "baseline": base_summary}
        write_json(args.json, _jsonable(data))
    if args.plot:
        from pdserve.bench.plot import plot

        plot(args.plot, runs, summaries, baseline, base_summary,
             title=f"pdserve bench: {args.workload}, {total} requests")
    return 0 if any(s["completed"] for s in summaries) else 1


def _backend(args: argparse.Namespace, address: str | None, sampling: RequestSampling):
    """The target: an OpenAI-compatible server over HTTP, else the gateway's gRPC API."""
    if args.openai_url:
        from pdserve.bench.openai_client import OpenAICompletions

        return OpenAICompletions(args.openai_url, args.openai_model, args.timeout_s, args.openai_api_key,
                                 sampling, chat=args.openai_endpoint == "chat")
    from pdserve.bench.client import GrpcGateway

    return GrpcGateway(address, args.timeout_s, sampling)


def _sampling(args: argparse.Namespace) -> RequestSampling:
    return RequestSampling(args.temperature, args.top_p, args.top_k, args.min_p, args.seed)


def _jsonable(value):
    """Strict JSON: inf and NaN (rate "inf", an empty run's rates) become strings / null."""
    import math

    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
