"""pdserve bench: metrics against numpy on known samples, arrival processes against their
distributions, workloads' shapes, and the client timing a fake gateway whose delays are known."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import grpc
import numpy as np
import pytest

from conftest import STORIES_GGUF
from pdserve.bench import arrivals, report, workloads
from pdserve.bench.client import GrpcGateway, RequestRecord, RunResult, run_workload
from pdserve.cli import build_parser
from pdserve.v1 import gateway_pb2_grpc


# ---- report -----------------------------------------------------------------------------------

def _records() -> list[RequestRecord]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(40):
        n = int(rng.integers(1, 20))
        ttft = float(rng.uniform(0.01, 0.4))
        itl = rng.uniform(0.001, 0.05, size=n - 1).tolist()
        out.append(RequestRecord(f"c{i}", 0, i * 0.1, prompt_tokens=10 + i, output_tokens=n, ttft=ttft,
                                 latency=ttft + sum(itl), itl=itl))
    out.append(RequestRecord("bad", 0, 1.0, status="RESOURCE_EXHAUSTED"))
    out.append(RequestRecord("bad2", 0, 1.0, status="UNAVAILABLE"))
    out.append(RequestRecord("bad3", 0, 1.0, status="UNAVAILABLE"))
    return out


def test_summary_matches_numpy_on_known_samples() -> None:
    records = _records()
    ok = [r for r in records if r.ok]
    s = report.summarize(RunResult("x", records, 8.0, 5.0), report.Slo(200, 20))
    ttft = np.array([r.ttft for r in ok]) * 1000
    e2e = np.array([r.latency for r in ok]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]) * 1000
    itl = np.concatenate([r.itl for r in ok]) * 1000
    for key, ref in (("ttft_ms", ttft), ("e2e_ms", e2e), ("tpot_ms", tpot), ("itl_ms", itl)):
        assert s[key]["mean"] == pytest.approx(ref.mean())
        for q in (50, 90, 99):
            assert s[key][f"p{q}"] == pytest.approx(np.percentile(ref, q)), (key, q)
    out_tokens = sum(r.output_tokens for r in ok)
    assert s["completed"] == 40 and s["failed"] == 3
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s["request_throughput"] == pytest.approx(40 / 8.0)
    assert s["output_throughput"] == pytest.approx(out_tokens / 8.0)
    assert s["total_token_throughput"] == pytest.approx((out_tokens + sum(r.prompt_tokens for r in ok)) / 8.0)
    # goodput counted by hand: TTFT <= 200 ms and (one token, or TPOT <= 20 ms)
    good = sum(1 for r in ok if r.ttft <= 0.2 and (r.output_tokens < 2 or
                                                    (r.latency - r.ttft) / (r.output_tokens - 1) <= 0.02))
    assert 0 < good < 40
    assert s["goodput"] == pytest.approx(good / 8.0)
    assert s["request_rate"] == 5.0


def test_tables_show_every_run_and_ratio() -> None:
    a = report.summarize(RunResult("pdserve", _records(), 8.0), report.Slo(200, 20))
    b = report.summarize(RunResult("transformers", _records()[:20], 16.0), report.Slo(200, 20))
    table = report.format_comparison([a], b)
    row = next(line for line in table.splitlines() if line.startswith("requests/s"))
    # 40 req / 8 s vs 20 req / 16 s = 5.0 vs 1.25 -> 4.00x
    assert row.split()[-3:] == ["5.0", "1.2", "4.00x"]
    assert "RESOURCE_EXHAUSTED 1" in table
    sweep = report.format_sweep([a, {**a, "request_rate": 2.0}])
    assert sweep.splitlines()[2].split()[0] == "inf" and sweep.splitlines()[3].split()[0] == "2"


# ---- arrivals ---------------------------------------------------------------------------------

def test_poisson_arrivals_have_exponential_gaps() -> None:
    offsets = arrivals.start_offsets(20001, rate=8.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert offsets == arrivals.start_offsets(20001, rate=8.0, seed=1)  # seeded


def test_burstiness_is_the_gamma_shape() -> None:
    gaps = np.diff(arrivals.start_offsets(20001, rate=4.0, burstiness=0.25, seed=2))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # the rate does not change
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1 / sqrt(shape)


def test_infinite_rate_starts_everything_at_once() -> None:
    assert arrivals.start_offsets(5, math.inf) == [0.0] * 5
    assert arrivals.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    with pytest.raises(ValueError):
        arrivals.parse_rates("0,1")


# ---- workloads --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.runtime.loader import load_checkpoint

    return load_checkpoint(STORIES_GGUF).tokenizer


def test_random_workload_lengths(tokenizer) -> None:
    spec = workloads.WorkloadSpec("random", 50, input_len=40, output_len=20, range_ratio=0.5)
    convs = workloads.build(spec, tokenizer, seed=0)
    assert len(convs) == 50 and all(len(c.turns) == 1 and not c.session for c in convs)
    assert all(10 <= c.turns[0].max_tokens <= 30 for c in convs)
    lens = [len(tokenizer.encode(c.turns[0].text, add_bos=False)) for c in convs]
    assert 20 * 0.7 <= min(lens) and max(lens) <= 60 * 1.3  # re-tokenized text: close to [20, 60]
    assert workloads.build(spec, tokenizer, seed=0) == convs
    assert workloads.build(spec, tokenizer, seed=1) != convs


def test_shared_prefix_workload(tokenizer) -> None:
    convs = workloads.build(workloads.WorkloadSpec("shared-prefix", 12, input_len=8, num_prefixes=3,
                                                   prefix_len=32), tokenizer, seed=0)
    prompts = [c.turns[0].text for c in convs]
    assert len(set(prompts)) == 12
    # request i uses prefix i % 3: requests 3 apart share (at least) that whole prefix
    shared = [os.path.commonprefix(prompts[i::3]) for i in range(3)]
    assert len(set(shared)) == 3
    assert all(len(tokenizer.encode(p, add_bos=False)) >= 32 * 0.7 for p in shared)


def test_sessions_workload(tokenizer) -> None:
    convs = workloads.build(workloads.WorkloadSpec("sessions", 10, turns=3, think_time_s=0.05), tokenizer, seed=0)
    assert [len(c.turns) for c in convs] == [3, 3, 3, 1] and workloads.num_requests(convs) == 10
    assert all(c.session and c.think_time_s == 0.05 for c in convs)
    assert len({c.id for c in convs}) == 4


def test_sharegpt_file(tmp_path, tokenizer) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Tell me a story."},
                           {"from": "gpt", "value": "Once upon a time there was a cat."}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"prompt": "A plain prompt", "output_len": 7},
    ]))
    convs = workloads.build(workloads.WorkloadSpec("file", 10, output_len=5, dataset=str(path)), tokenizer, seed=0)
    by_text = {c.turns[0].text: c.turns[0].max_tokens for c in convs}
    assert by_text == {"Tell me a story.": len(tokenizer.encode("Once upon a time there was a cat.", add_bos=False)),
                       "A plain prompt": 7}


# ---- the client against a fake gateway with known delays -----------------------------------------

FIRST_DELAY_S = 0.05
GAP_S = 0.01


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams max_tokens one-token chunks: the first after 50 ms, then every 10 ms; text "t" each."""

    def __init__(self) -> None:
        self.prompts: list[tuple[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def Generate(self, request, context):
        from pdserve.v1 import common_pb2, gateway_pb2

        if "busy" in request.prompt:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        self.prompts.append((request.session_id, request.prompt))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(FIRST_DELAY_S)
            n = request.sampling.max_tokens
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                msg = gateway_pb2.GenerateResponse(request_id=request.request_id, text="t", token_ids=[7])
                if i == n - 1:
                    msg.finish_reason = "length"
                    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt), completion_tokens=n))
                yield msg
        finally:
            self.in_flight -= 1


async def _with_fake(body):
    from pdserve.grpc_server import start_server, stop_server

    fake = FakeGateway()

    def add(server):
        gateway_pb2_grpc.add_GatewayServicer_to_server(fake, server)
    server, port = await start_server("127.0.0.1:0", add, ["pdserve.v1.Gateway"])
    backend = GrpcGateway(f"127.0.0.1:{port}", timeout_s=10)
    try:
        return fake, await body(backend)
    finally:
        await backend.close()
        await stop_server(server, 0)


def test_client_times_known_delays_and_counts_errors() -> None:
    convs = [workloads.Conversation(f"c{i}", (workloads.Turn(f"p{i}", 5),)) for i in range(4)]
    convs.append(workloads.Conversation("x", (workloads.Turn("busy", 5),)))
    fake, run = asyncio.run(_with_fake(lambda b: run_workload(b, convs, [0.0] * 5, max_concurrency=2)))
    s = report.summarize(run, report.Slo())
    assert s["completed"] == 4 and s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert fake.max_in_flight <= 2  # the concurrency cap held
    ok = [r for r in run.records if r.ok]
    assert all(r.output_tokens == 5 and r.prompt_tokens == 2 and r.text == "ttttt" for r in ok)
    # TTFT at least the server's delay; on a loaded machine maybe more, but not by a lot
    assert all(FIRST_DELAY_S <= r.ttft < FIRST_DELAY_S + 0.25 for r in ok)
    # Each gap as the client sees it can shrink (a late token followed by an on-time one), so bound
    # what cannot: the last token comes no earlier than the server's first delay plus its four gaps.
    assert all(len(r.itl) == 4 and all(g >= 0 for g in r.itl) for r in ok)
    assert all(r.latency >= (FIRST_DELAY_S + 4 * GAP_S) * 0.99 for r in ok)


def test_sessions_extend_the_prompt_with_think_time() -> None:
    conv = workloads.Conversation("s0", (workloads.Turn("hello", 3), workloads.Turn(" more", 2),
                                         workloads.Turn(" again", 1)), session=True, think_time_s=0.1)
    t0 = time.perf_counter()
    fake, run = asyncio.run(_with_fake(lambda b: run_workload(b, [conv], [0.0], run_id="run")))
    assert [p for _, p in fake.prompts] == ["hello", "hellottt more", "hellottt morett again"]
    assert {sid for sid, _ in fake.prompts} == {"run-s0"}
    starts = [r.start for r in sorted(run.records, key=lambda r: r.turn)]
    # each turn starts after the previous one's answer and the think time
    assert starts[1] - starts[0] >= FIRST_DELAY_S + 2 * GAP_S + 0.1 * 0.9
    assert time.perf_counter() - t0 >= 0.2


def test_open_loop_starts_on_schedule() -> None:
    # Each request lasts at least the server's 50 ms + 99 x 10 ms, five times the schedule's span:
    # an open loop starts each at its time (never before), without waiting for the others, so all
    # three are in flight at once; a closed loop would have one. (No upper bound on a start time:
    # a loaded machine may start one late.)
    convs = [workloads.Conversation(f"c{i}", (workloads.Turn("p", 100),)) for i in range(3)]
    fake, run = asyncio.run(_with_fake(lambda b: run_workload(b, convs, [0.0, 0.1, 0.2])))
    starts = sorted(r.start for r in run.records)
    assert 0.1 <= starts[1] and 0.2 <= starts[2]
    assert fake.max_in_flight == 3


def test_cli_flags_parse_without_heavy_imports() -> None:
    args = build_parser().parse_args(["bench", "--server", "h:1", "--workload", "sessions", "--sweep", "1,inf",
                                      "--slo-ttft-ms", "100", "--baseline", "hf", "--max-concurrency", "8"])
    assert (args.workload, args.sweep, args.slo_ttft_ms, args.baseline, args.max_concurrency) == \
        ("sessions", "1,inf", 100.0, "hf", 8)
    assert args.request_rate == math.inf


def test_no_target_is_a_usage_error(capsys) -> None:
    args = build_parser().parse_args(["bench"])
    assert args._run(args) == 2
    assert "--server" in capsys.readouterr().err


def test_bench_kv_think_times_and_documents() -> None:
    """The sessions scenario's workload: regular sessions stay within their jitter around their
    own mean; exponential ones have the asked mean; a document is at least the asked length."""
    import argparse
    import random
    import statistics

    from pdserve.commands.bench_kv import story_text, think_times
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path

    regular = think_times(argparse.Namespace(think_model="regular", think_s=4.0, think_jitter=0.2), random.Random(1))
    gaps = [regular() for _ in range(200)]
    assert min(gaps) / max(gaps) >= 0.8 / 1.2 - 1e-9  # within +-20 % of one mean in [2, 6] s
    assert 2.0 * 0.8 <= min(gaps) and max(gaps) <= 6.0 * 1.2
    memoryless = think_times(argparse.Namespace(think_model="exponential", think_s=4.0, think_jitter=0.2),
                             random.Random(2))
    assert 3.0 < statistics.mean(memoryless() for _ in range(4000)) < 5.0
    tok = load_checkpoint(resolve_model_path(None)).tokenizer
    text = story_text(tok, random.Random(3), 300)
    assert 300 <= len(tok.encode(text, add_bos=False)) < 340


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_transformers_baseline_runs_in_the_checkpoints_dtype(dtype):
    """bench-engine's baseline multiplies what the engine multiplies: a bf16 checkpoint gives a bf16
    transformers model (it was fp32 whatever the weights, which flattered bf16 engines 1.7x)."""
    import torch

    from pdserve.hf_baseline import hf_model
    from pdserve.runtime.loader import load_checkpoint

    ck = load_checkpoint(STORIES_GGUF, dtype=getattr(torch, dtype))
    model = hf_model(ck.config, ck.weights)
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    embed = ck.weights[ck.config.arch.global_name("embed")]
    assert torch.equal(model.get_input_embeddings().weight, embed)
