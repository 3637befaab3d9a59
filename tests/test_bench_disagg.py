"""pdserve bench-disagg: the mixed workload's classes, the per-class summary against numpy, the
ratios, and one tiny run of the command on real stacks (stories260K)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from conftest import STORIES_GGUF
from pdserve.bench.client import RequestRecord, RunResult
from pdserve.cli import build_parser
from pdserve.commands import bench_disagg
from pdserve.runtime.loader import load_checkpoint


def _args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench-disagg", *extra])


def test_mixed_workload_has_both_classes_in_their_ranges() -> None:
    tok = load_checkpoint(STORIES_GGUF).tokenizer
    args = _args("--requests", "200", "--short", "8-32", "--long", "100-120", "--seed", "3")
    convs = bench_disagg.mixed_workload(args, tok)
    shorts = [c for c in convs if c.id.startswith("short")]
    assert 140 <= len(shorts) <= 180  # 80 % of 200, seeded
    for conv in convs:
        n = len(tok.encode(conv.turns[0].text))
        lo, hi = (8, 32) if conv.id.startswith("short") else (100, 120)
        assert lo - 4 <= n <= hi + 4, (conv.id, n)  # text round trips change a few tokens
    assert [c.turns[0].text for c in bench_disagg.mixed_workload(args, tok)] == [c.turns[0].text for c in convs]


def test_token_range_flag() -> None:
    assert bench_disagg.token_range("8-32") == (8, 32)
    assert bench_disagg.token_range("5") == (5, 5)
    for bad in ("32-8", "a-b", "0-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="MIN"):
            bench_disagg.token_range(bad)


def test_rounds_cut_the_arrivals_into_slices_from_zero() -> None:
    convs, offsets = list("abcdefg"), [0.0, 0.5, 1.0, 2.0, 2.5, 4.0, 7.0]
    assert bench_disagg.rounds(convs, offsets, 3) == [
        (["a", "b", "c"], [0.0, 0.5, 1.0]), (["d", "e", "f"], [0.0, 0.5, 2.0]), (["g"], [0.0])]
    assert bench_disagg.rounds(convs, offsets, 1) == [(convs, offsets)]


def test_summary_per_class_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    records = []
    for i in range(30):
        cls = "short" if i % 3 else "long"
        ttft = float(rng.uniform(0.01, 2.0))
        records.append(RequestRecord(f"{cls}-{i}", 0, 0.0, output_tokens=5, ttft=ttft, latency=ttft + 0.4))
    records.append(RequestRecord("long-99", 0, 0.0, status="UNAVAILABLE"))
    out = bench_disagg.summarize_arm(RunResult("x", records, 10.0), remote_prefills=12)
    assert (out["completed"], out["failed"], out["prefilled_local"]) == (30, 1, 18)
    for cls in ("short", "long", "all"):
        ttft = np.array([r.ttft for r in records if r.ok and (cls == "all" or r.conversation.startswith(cls))])
        assert out[cls]["ttft_p50_ms"] == pytest.approx(np.percentile(ttft * 1000, 50), abs=0.051)
        assert out[cls]["ttft_p99_ms"] == pytest.approx(np.percentile(ttft * 1000, 99), abs=0.051)
        assert out[cls]["tpot_p50_ms"] == pytest.approx(100.0, abs=0.051)


def test_ratios_are_against_the_first_arm() -> None:
    arm = lambda p50, rps: {"requests_per_s": rps, **{c: {"ttft_p50_ms": p50, "ttft_p99_ms": None,  # noqa: E731
                                                          "tpot_p50_ms": 10.0} for c in ("short", "long", "all")}}
    r = bench_disagg.ratios({"always-remote": arm(200.0, 2.0), "conditional": arm(50.0, 2.5)})
    row = r["conditional/always-remote"]
    assert (row["short_ttft_p50_ms"], row["all_ttft_p99_ms"], row["requests_per_s"]) == (0.25, None, 1.25)


def test_bad_arms_are_a_usage_error(capsys) -> None:
    args = _args("--arms", "always-remote,sometimes")
    assert args._run(args) == 2
    assert "--arms takes always-remote, always-local, conditional" in capsys.readouterr().err


def test_tiny_run_on_real_stacks(tmp_path, capsys) -> None:
    """Both arms complete every request; always-remote prefills all of them on the prefill worker,
    the conditional arm prefills the short ones (under its threshold) on the decode worker."""
    out = tmp_path / "out.json"
    args = _args("--model", str(STORIES_GGUF), "--requests", "8", "--short", "4-8", "--long", "60-80",
                 "--max-tokens", "4", "--rate", "4", "--rounds", "2", "--local-prefill-max-tokens", "20",
                 "--json", str(out))
    assert args._run(args) == 0
    data = json.loads(out.read_text())
    remote, cond = data["arms"]["always-remote"], data["arms"]["conditional"]
    assert remote["completed"] == cond["completed"] == 8
    assert (remote["prefilled_remote"], remote["prefilled_local"]) == (8, 0)
    assert cond["prefilled_local"] >= data["short_requests"] > 0
    assert set(data["ratios"]) == {"conditional/always-remote"}
    assert "short ttft p99 ms" in capsys.readouterr().out
