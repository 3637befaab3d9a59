"""`pdserve step-log FILE...`: the summary of workers' step logs (`--step-log-dir`,
pdserve.runtime.step_log): how full the steps were, how long they took on how many threads, and
how much of the run the engine thread spent inside them. A table per file, and JSON with --json."""

from __future__ import annotations

import argparse

from pdserve.commands.output import write_json

NAME = "step-log"
HELP = "summarize workers' step logs (--step-log-dir): steps by batch size and threads"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="step logs (DIR/<kind>-<pid>.jsonl)")
    p.add_argument("--json", default=None, help="write the summaries as JSON to this path ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    from pdserve.runtime.step_log import read, summarize

    try:
        summaries = {path: summarize(read(path)) for path in args.files}
    except (OSError, ValueError, TypeError) as err:  # a missing file, a line that is not a step record
        raise SystemExit(f"pdserve step-log: {err}") from None
    for path, summary in summaries.items():
        print(format_summary(path, summary))
    if args.json:
        write_json(args.json, summaries)
    return 0


def format_summary(path: str, s: dict) -> str:
    if not s["steps"]:
        return f"{path}: no steps"
    lines = [f"{path}: {s['steps']} steps over {s['span_s']:.2f} s, {100 * s['in_steps_share']:.0f} % inside steps; "
             f"{s['mean_decodes']:.1f} sequences decoded a step on average; {s['prompt_tokens']} prompt tokens, "
             f"{s['blocks_loaded']} KV blocks loaded",
             f"{'steps':<14} {'threads':>7} {'count':>6} {'mean ms':>8} {'median ms':>9} {'cpu ms':>7} "
             f"{'decodes':>7} {'prompt tok':>10}"]
    for g in s["groups"]:
        lines.append(f"{g['kind']:<14} {g['threads']:>7} {g['steps']:>6} {g['mean_ms']:>8.1f} {g['median_ms']:>9.1f} "
                     f"{g['mean_cpu_ms']:>7.1f} {g['mean_decodes']:>7.1f} {g['mean_prompt_tokens']:>10.1f}")
    return "\n".join(lines)
