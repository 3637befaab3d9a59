"""Figures of a benchmark (matplotlib, the optional `plot` extra): latency CDFs of every run, and
for a sweep, throughput and latency against the offered request rate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.client import RunResult
from pdserve.bench.report import samples


def plot(path: str, runs: Sequence[RunResult], summaries: Sequence[dict[str, Any]],
         baseline: RunResult | None = None, baseline_summary: dict[str, Any] | None = None,
         title: str = "pdserve bench") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sweep = len(runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8.5 if sweep else 4.5), squeeze=False)
    everything = [*runs, *([baseline] if baseline else [])]
    for ax, kind, name in zip(axes[0], ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end latency")):
        for run in everything:
            values = np.sort(np.asarray(samples(run.records)[kind]) * 1000)
            if len(values):
                style = "--" if run is baseline else "-"
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), style, label=run.label)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # minor labels overlap
        ax.set_xlabel(f"{name} (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if sweep:
        _sweep_axes(axes[1], summaries, baseline_summary)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_axes(axes, summaries: Sequence[dict[str, Any]], baseline: dict[str, Any] | None) -> None:
    finite = [s["request_rate"] for s in summaries if s["request_rate"] is not None]
    top = max(finite, default=1.0)
    # "inf" (everything at once) is drawn one step past the largest finite rate
    rates = [s["request_rate"] if s["request_rate"] is not None else top * 2 for s in summaries]
    ax = axes[0]
    ax.plot(rates, [s["output_throughput"] for s in summaries], "o-", label="pdserve output tok/s")
    if baseline:
        ax.axhline(baseline["output_throughput"], linestyle="--", color="gray", label=f"{baseline['label']} (offline)")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs request rate")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(rates, [s["request_throughput"] for s in summaries], "o-", label="completed req/s")
    ax.plot(rates, [s["goodput"] for s in summaries], "s--", label="goodput req/s")
    offered = [(r, s["request_rate"]) for r, s in zip(rates, summaries) if s["request_rate"] is not None]
    if offered:
        ax.plot([x for x, _ in offered], [y for _, y in offered], ":", color="gray", label="offered")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_title("requests/s and goodput vs rate")
    ax.legend(fontsize=8)
    ax = axes[2]
    for kind, marker in (("ttft", "o"), ("e2e", "s")):
        for q, style in (("p50", "-"), ("p99", "--")):
            ax.plot(rates, [s[f"{kind}_ms"][q] or math.nan for s in summaries], marker + style,
                    label=f"{kind.upper()} {q}")
    ax.set_yscale("log")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("ms (log)")
    ax.set_title("latency vs request rate")
    ax.legend(fontsize=8)
    for a in axes:
        a.grid(True, alpha=0.3)
        if any(s["request_rate"] is None for s in summaries):
            a.set_xticks(rates, [f"{r:g}" if s["request_rate"] is not None else "inf"
                                 for r, s in zip(rates, summaries)])
