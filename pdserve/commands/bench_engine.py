"""`pdserve bench-engine`: our engine (continuous batching) vs transformers `generate()`
(static batches) on the same requests and weights, in one process. Prints a table, and
JSON with --json."""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass

from pdserve.commands.output import write_json

NAME = "bench-engine"
HELP = "benchmark the in-process engine against transformers generate() on the same requests"


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class RunResult:
    name: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_engine_args

    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(4, 40), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=32, help="static batch of the transformers baseline")
    p.add_argument("--skip-hf", action="store_true", help="only run pdserve")
    p.add_argument("--json", default=None, help="write the results as JSON to this path ('-': stdout)")
    add_engine_args(p)


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_requests)]
    return Workload(prompts, [rng.randint(*args.output_len) for _ in range(args.num_requests)])


def run_pdserve(engine, work: Workload) -> RunResult:
    from pdserve.runtime.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return RunResult("pdserve", time.perf_counter() - start, work.output_tokens)


def run_transformers(model, work: Workload, batch_size: int) -> RunResult:
    """Static batches: each batch runs until its longest request is done (left padding)."""
    import torch

    start = time.perf_counter()
    for b in range(0, len(work.prompts), batch_size):
        prompts, lens = work.prompts[b:b + batch_size], work.output_lens[b:b + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(lens),
                           min_new_tokens=max(lens), pad_token_id=0)
    return RunResult("transformers", time.perf_counter() - start, work.output_tokens)


def report(results: list[RunResult], work: Workload, args: argparse.Namespace) -> dict:
    data = {"num_requests": len(work.prompts), "output_tokens": work.output_tokens,
            "max_batch_size": args.max_batch_size, "hf_batch_size": args.hf_batch_size,
            "runs": [asdict(r) | {"output_tokens_per_s": round(r.tokens_per_s, 1)} for r in results]}
    if len(results) == 2:
        data["ratio"] = round(results[0].tokens_per_s / results[1].tokens_per_s, 2)
    print(f"{'engine':<14}{'seconds':>10}{'output tok':>12}{'tok/s':>10}")
    for r in results:
        print(f"{r.name:<14}{r.seconds:>10.2f}{r.output_tokens:>12}{r.tokens_per_s:>10.1f}")
    if "ratio" in data:
        print(f"pdserve / transformers output tokens/s: {data['ratio']:.2f}x")
    return data


def run(args: argparse.Namespace) -> int:
    from pdserve.engine_args import build_engine
    from pdserve.hf_baseline import hf_model

    engine, checkpoint = build_engine(args)
    work = make_workload(args, checkpoint.config.vocab_size)
    run_pdserve(engine, make_workload(argparse.Namespace(**{**vars(args), "num_requests": 4}), 64))  # warm-up
    results = [run_pdserve(engine, work)]
    if not args.skip_hf:
        model = hf_model(checkpoint.config, checkpoint.weights).to(args.device)  # the engine's device
        results.append(run_transformers(model, work, args.hf_batch_size))
    data = report(results, work, args)
    if args.json:
        write_json(args.json, data)
    engine.check_leaks()
    return 0

