"""Metrics of a benchmark run, and how they are printed.

Per request: TTFT, ITL (chunk gaps), TPOT = (latency - TTFT) / (output tokens - 1) for requests with
two or more tokens, end-to-end latency. Per run: request, output-token and total-token throughput
over the run's wall time; mean, P50, P90 and P99 of each latency (numpy's linear interpolation);
goodput = completed requests per second that met every given SLO (TTFT <= --slo-ttft-ms and
TPOT <= --slo-tpot-ms); failures counted by gRPC status.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.client import RequestRecord, RunResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        tpot = request_tpot(r)
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def request_tpot(r: RequestRecord) -> float | None:
    if r.ttft is None or r.latency is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (None for an empty sample)."""
    if len(values_s) == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = np.asarray(values_s, dtype=float) * 1000
    return {"mean": float(ms.mean()), **{f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}}


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Every latency sample of the successful requests, in seconds, by kind."""
    ok = [r for r in records if r.ok]
    return {"ttft": [r.ttft for r in ok if r.ttft is not None],
            "tpot": [t for t in map(request_tpot, ok) if t is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "e2e": [r.latency for r in ok if r.latency is not None]}


def summarize(run: RunResult, slo: Slo) -> dict[str, Any]:
    ok = [r for r in run.records if r.ok]
    duration = run.duration_s if run.duration_s > 0 else math.nan
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    good = sum(slo.met(r) for r in ok)
    out: dict[str, Any] = {
        "label": run.label, "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "duration_s": run.duration_s, "completed": len(ok), "failed": len(run.records) - len(ok),
        "errors": dict(Counter(r.status for r in run.records if not r.ok)),
        "prompt_tokens": prompt, "output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "goodput": good / duration, "goodput_fraction": good / len(ok) if ok else 0.0,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    }
    for kind, values in samples(run.records).items():
        out[f"{kind}_ms"] = distribution_ms(values)
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


ROWS: tuple[tuple[str, str, str | None, bool], ...] = (
    # (label, key, sub-key, higher is better)
    ("requests/s", "request_throughput", None, True),
    ("output tokens/s", "output_throughput", None, True),
    ("total tokens/s", "total_token_throughput", None, True),
    ("goodput (req/s)", "goodput", None, True),
    *((f"{kind.upper()} {stat} (ms)", f"{kind}_ms", stat, False)
      for kind in LATENCIES for stat in ("mean", "p50", "p90", "p99")),
)


def format_comparison(runs: Sequence[dict[str, Any]], baseline: dict[str, Any] | None = None) -> str:
    """Metrics as rows, runs as columns; with a baseline, its column and run/baseline ratios beside."""
    columns = [*runs, *([baseline] if baseline else [])]
    width = max(14, *(len(c["label"]) + 2 for c in columns))
    ratio_heads = [r["label"].replace("pdserve", "ratio", 1) for r in runs] if baseline else []
    head = f"{'metric':<22}" + "".join(f"{c['label']:>{width}}" for c in columns) \
        + "".join(f"{h:>{width}}" for h in ratio_heads)
    lines = [head, "-" * len(head)]
    for label, key, sub, _ in ROWS:
        vals = [c[key][sub] if sub else c[key] for c in columns]
        line = f"{label:<22}" + "".join(f"{_fmt(v):>{width}}" for v in vals)
        if baseline:
            base = vals[-1]
            for v in vals[:-1]:
                cell = f"{v / base:.2f}x" if v is not None and base else "-"
                line += f"{cell:>{width}}"
        lines.append(line)
    for c in columns:
        if c["failed"]:
            lines.append(f"{c['label']}: {c['failed']} failed: "
                         + ", ".join(f"{k} {n}" for k, n in sorted(c["errors"].items())))
    slo = columns[0]["slo"]
    lines.append("completed: " + ", ".join(f"{c['label']} {c['completed']}" for c in columns)
                 + f"; goodput SLO: TTFT <= {_fmt(slo['ttft_ms'], 0)} ms, TPOT <= {_fmt(slo['tpot_ms'], 0)} ms")
    if baseline:
        lines.append(f"ratio = pdserve / {baseline['label']}: above 1 is better for rates, below 1 for latencies")
    return "\n".join(lines)


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One row per request rate."""
    head = (f"{'rate':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
            f"{'TPOT p99':>10}{'E2E p50':>10}{'E2E p99':>10}{'goodput':>9}{'errors':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
        lines.append(f"{rate:>6}{_fmt(r['request_throughput'], 2):>8}{_fmt(r['output_throughput']):>11}"
                     f"{_fmt(r['ttft_ms']['p50']):>10}{_fmt(r['ttft_ms']['p99']):>10}"
                     f"{_fmt(r['tpot_ms']['p50'], 2):>10}{_fmt(r['tpot_ms']['p99'], 2):>10}"
                     f"{_fmt(r['e2e_ms']['p50']):>10}{_fmt(r['e2e_ms']['p99']):>10}"
                     f"{_fmt(r['goodput'], 2):>9}{r['failed']:>8}")
    lines.append("latencies in ms; rates and goodput in requests/s")
    return "\n".join(lines)
