"""`pdserve experiment report`: how the gateway's A/B experiments are going, arm by arm.

Asks the gateway's ExperimentReport rpc and prints, per arm: requests and their share, the mean
reward with its 95% confidence interval, TTFT and TPOT P50/P99, errors, feedback received, the
policy's current allocation and whether the arm's deployment is up; `--json FILE` (or `-`) writes
the same rows as JSON. See docs/experiments.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

NAME = "experiment"
HELP = "inspect the gateway's A/B experiments (report: per-arm requests, reward, latency, allocation)"

COLUMNS = ("experiment", "arm", "requests", "share", "reward (95% CI)", "ttft p50/p99 ms", "tpot p50/p99 ms",
           "errors", "feedback", "allocation", "up")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    report = sub.add_parser("report", help="per-arm statistics of every experiment of a gateway")
    report.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT", help="the gateway's gRPC address")
    report.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON (- for stdout only)")
    report.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the gateway")


def fetch_report(address: str, timeout_s: float) -> list[dict[str, Any]]:
    """The gateway's report rows as dicts (the ArmReport fields)."""
    import grpc

    from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).ExperimentReport(
            gateway_pb2.ExperimentReportRequest(), timeout=timeout_s)
    return [{f.name: getattr(arm, f.name) for f in arm.DESCRIPTOR.fields} for arm in reply.arms]


def _ms_pair(row: dict[str, Any], metric: str) -> str:
    return f"{row[f'{metric}_p50_s'] * 1e3:.1f}/{row[f'{metric}_p99_s'] * 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table, one line per arm."""
    if not rows:
        return "the gateway runs no experiment (see `pdserve gateway --config`)"
    cells = [COLUMNS]
    for r in rows:
        reward = f"{r['reward_mean']:.3f} ± {r['reward_ci95']:.3f} (n={r['rewarded']})"
        cells.append((r["experiment"], r["arm"], str(r["requests"]), f"{r['share']:.1%}", reward,
                      _ms_pair(r, "ttft"), _ms_pair(r, "tpot"), str(r["errors"]), str(r["feedback"]),
                      f"{r['allocation']:.1%}", "yes" if r["up"] else "DOWN"))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.commands.output import write_json

    try:
        rows = fetch_report(args.gateway, args.timeout)
    except grpc.RpcError as err:
        print(f"pdserve experiment report: gateway {args.gateway}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    if args.json:
        write_json(args.json, {"gateway": args.gateway, "arms": rows})
    if args.json != "-":
        print(table(rows))
    return 0
