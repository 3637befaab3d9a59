"""`pdserve bench-overload`: its steady-state rate and summary on known records, and one fast run
on a real stack with an SLO (1 ms) nothing meets: the baseline gateway completes every request,
the admission gateway refuses every open-loop request with a retry-after hint."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.client import RequestRecord, RunResult
from pdserve.commands import bench_overload
from pdserve.commands.bench_overload import Refusal, saturated_rate, summarize


def _ok(start: float, latency: float, ttft: float = 0.1, tokens: int = 4) -> RequestRecord:
    return RequestRecord("c", 0, start, output_tokens=tokens, ttft=ttft, latency=latency)


def test_saturated_rate_counts_completions_while_every_client_was_busy():
    # Two clients, one request each second per client after a slow first round; the last send at 10 s.
    records = [_ok(0.0, 3.0), _ok(0.0, 3.0)]
    records += [_ok(3.0 + k * 0.5, 0.5) for k in range(14)]  # ends 3.5 .. 10.0: 2 per second
    records += [_ok(10.0, 5.0)]  # the tail after the last send does not count
    assert saturated_rate(records, concurrency=2) == pytest.approx(2.0)


def test_saturated_rate_of_a_run_too_short_for_a_steady_state_is_the_whole_runs():
    # 8 requests on 4 clients within 0.4 s, two of them ending a microsecond apart after the
    # warm-up: not a million requests per second but 8 in 0.4 s.
    records = [_ok(0.0, 0.1), _ok(0.0, 0.1), _ok(0.0, 0.1), _ok(0.0, 0.1),
               _ok(0.1, 0.2), _ok(0.1, 0.200001), _ok(0.15, 0.25), _ok(0.2, 0.2)]
    assert saturated_rate(records, concurrency=4) == pytest.approx(20.0)


def test_summary_separates_refusals_from_other_failures_and_measures_the_slo_share():
    records = [_ok(0.0, 1.0, ttft=0.2), _ok(0.1, 1.0, ttft=0.8),
               RequestRecord("x", 0, 0.2, status="RESOURCE_EXHAUSTED"),
               RequestRecord("y", 0, 0.3, status="DEADLINE_EXCEEDED")]
    s = summarize(RunResult("run", records, 2.0), [Refusal(0.004, 1.5)], slo_ms=500)
    assert (s["completed"], s["refused"], s["other_errors"]) == (2, 1, {"DEADLINE_EXCEEDED": 1})
    assert s["within_slo"] == 0.5 and s["goodput_per_s"] == 0.5 and s["completed_per_s"] == 1.0
    assert s["refusal_p50_ms"] == 4.0 and s["retry_after_p50_ms"] == 1500.0


def test_bench_overload_runs_both_gateways(tmp_path, capsys):
    from pdserve.cli import build_parser

    out = tmp_path / "overload.json"
    args = build_parser().parse_args([
        "bench-overload", "--slo-ms", "1", "--overload", "2", "--duration", "1", "--concurrency", "4",
        "--calibrate-requests", "8", "--input-len", "8", "--output-len", "4", "--json", str(out)])
    assert bench_overload.run(args) == 0
    data = json.loads(out.read_text())
    baseline, admission = data["runs"]
    assert baseline["label"] == "admission off" and admission["label"] == "admission on"
    assert baseline["refused"] == 0 and baseline["completed"] > 0  # no admission: only the cap refuses
    assert baseline["completed"] + sum(baseline["other_errors"].values()) == baseline["offered"]
    assert admission["refused"] == admission["offered"] and admission["completed"] == 0
    assert admission["refusal_p99_ms"] is not None and admission["retry_after_p50_ms"] >= 0
    assert "admission on" in capsys.readouterr().out


def test_histogram_quantile_interpolates_within_the_bucket_of_what_was_added():
    before = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, float("inf"): 5.0}  # earlier requests: not counted
    after = {0.1: 15.0, 0.5: 55.0, 1.0: 105.0, float("inf"): 105.0}  # +10, +40, +50 per bucket
    assert bench_overload.histogram_quantile(0.5, before, after) == pytest.approx(500.0)
    assert bench_overload.histogram_quantile(0.05, before, after) == pytest.approx(50.0)
    assert bench_overload.histogram_quantile(0.99, before, after) == pytest.approx(990.0)
    assert bench_overload.histogram_quantile(0.5, after, after) is None
