"""A worker's engine steps, one JSON line each (`--step-log-dir`), and their summary (`pdserve step-log`).

Why: where a served run's time goes is a question about steps (how full each was, how long it took
on how many threads, how much of the run the engine thread spent outside them), which the metrics'
histograms and the traces' spans do not answer together. Stop 47 measured it with a script outside
the repository; this is that record, kept by the worker itself. Off by default; when on, a step
costs a clock read, a CPU-time read and a list append on the engine thread, and the lines go to the
file every FLUSH_EVERY steps and when the engine stops.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)
FLUSH_EVERY = 64  # records kept in memory before they are written
BATCH_BUCKET = 4  # decode-only steps are summarized by batch size in buckets of this many sequences


@dataclass(frozen=True, slots=True)
class StepRecord:
    start_s: float  # time.perf_counter() when the step began (CLOCK_MONOTONIC on Linux: one host's logs line up)
    wall_ms: float  # the step's wall time (Engine.step)
    cpu_ms: float  # the engine thread's CPU time during it (its own share of the work, and any spinning)
    threads: int  # torch threads the step began on
    decodes: int
    prompt_tokens: int
    loads: int


class StepLog:
    """Appends StepRecords to `path` as JSON lines; `record` on the engine thread, `close` at its end."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")  # a fresh log for this worker's life
        self._pending: list[StepRecord] = []
        self.failed = False

    def record(self, rec: StepRecord) -> None:
        if self.failed:
            return
        self._pending.append(rec)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Writes the records kept so far. A log that cannot be written (a full disk) says so once and
        keeps nothing more: it is a measurement, and the engine goes on without it."""
        if not self._pending or self.failed:
            return
        try:
            with self.path.open("a") as f:
                f.writelines(json.dumps(asdict(r), separators=(",", ":")) + "\n" for r in self._pending)
        except OSError as err:
            self.failed = True
            log.warning("step log %s: %s; no more steps are logged", self.path, err)
        self._pending.clear()

    close = flush


def read(path: str | Path) -> list[StepRecord]:
    """The records of a step log, in order."""
    return [StepRecord(**json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: Iterable[StepRecord]) -> dict:
    """Steps, the span from the first step's start to the last one's end, the share of it inside
    steps, the mean sequences decoded a step; decode-only steps by (batch bucket, threads) and steps
    with prompt tokens (mean / median wall ms, mean CPU ms)."""
    recs = list(records)
    if not recs:
        return {"steps": 0}
    span_s = recs[-1].start_s + recs[-1].wall_ms / 1e3 - recs[0].start_s
    # (0, first batch size of the bucket, threads) for decode-only steps, (1, 0, threads) for prompt steps:
    # the table's order.
    groups: dict[tuple[int, int, int], list[StepRecord]] = defaultdict(list)
    for r in recs:
        if r.prompt_tokens:
            groups[(1, 0, r.threads)].append(r)
        elif r.decodes:
            groups[(0, (r.decodes - 1) // BATCH_BUCKET * BATCH_BUCKET + 1, r.threads)].append(r)
    rows = [{"kind": f"decode {low}-{low + BATCH_BUCKET - 1}" if not prompt else "prompt", "threads": threads,
             "steps": len(rs),
             "mean_ms": round(statistics.fmean(r.wall_ms for r in rs), 2),
             "median_ms": round(statistics.median(r.wall_ms for r in rs), 2),
             "mean_cpu_ms": round(statistics.fmean(r.cpu_ms for r in rs), 2),
             "mean_decodes": round(statistics.fmean(r.decodes for r in rs), 1),
             "mean_prompt_tokens": round(statistics.fmean(r.prompt_tokens for r in rs), 1)}
            for (prompt, low, threads), rs in sorted(groups.items())]
    return {"steps": len(recs), "span_s": round(span_s, 3),
            "in_steps_share": round(sum(r.wall_ms for r in recs) / 1e3 / span_s, 3) if span_s > 0 else 1.0,
            "mean_decodes": round(statistics.fmean(r.decodes for r in recs), 2),
            "prompt_tokens": sum(r.prompt_tokens for r in recs), "decoded_tokens": sum(r.decodes for r in recs),
            "blocks_loaded": sum(r.loads for r in recs), "groups": rows}

