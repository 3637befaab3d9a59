"""Prometheus metrics of a worker's engine (prefill and decode alike), recorded by AsyncEngine.

Default registry, defined once per process (a process runs one engine; tests that run several
share the series, which only makes the gauges "last writer wins"). Step time and batch size are
observed once per engine step; the gauges are refreshed once per engine loop turn, so they also
follow aborts and arrivals that happen between steps. Cost: a few microseconds a step.
"""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

from pdserve.runtime.engine import Engine

# Millisecond-resolving buckets: a step of stories260K takes ~1 ms, a large model's ~100 ms.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

STEP_SECONDS = Histogram("pdserve_engine_step_seconds", "Duration of one engine step (schedule, forward, sample)",
                         buckets=STEP_BUCKETS)
BATCH_SIZE = Histogram("pdserve_engine_batch_size", "Sequences scheduled in one engine step",
                       buckets=BATCH_BUCKETS)
QUEUE_SECONDS = Histogram("pdserve_engine_queue_seconds",
                          "From a request entering the engine to the start of the step that produced its "
                          "first token (waiting + earlier prefill chunks)", buckets=QUEUE_BUCKETS)
RUNNING = Gauge("pdserve_engine_running_seqs", "Sequences in the running batch")
WAITING = Gauge("pdserve_engine_waiting_seqs", "Sequences waiting to be scheduled")
KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV blocks of the paged cache held by sequences or cached")
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "KV blocks of the paged cache free for allocation")


def observe_step(seconds: float, batch_size: int) -> None:
    """One finished step that ran `batch_size` sequences."""
    STEP_SECONDS.observe(seconds)
    BATCH_SIZE.observe(batch_size)


def observe_queue(seconds: float) -> None:
    QUEUE_SECONDS.observe(seconds)


def refresh_gauges(engine: Engine) -> None:
    """Running/waiting sequences and KV blocks as the engine holds them now (engine thread only)."""
    scheduler, bm = engine.scheduler, engine.block_manager
    RUNNING.set(len(scheduler.running))
    WAITING.set(len(scheduler.waiting))
    free = bm.num_free_blocks
    KV_BLOCKS_FREE.set(free)
    KV_BLOCKS_USED.set(bm.num_blocks - free)


def last_batch_size(counts_before: dict[int, int], counts_after: dict[int, int]) -> int:
    """The batch size the engine recorded in its last step: the size whose count went up (0: no step)."""
    for size, count in counts_after.items():
        if count != counts_before.get(size, 0):
            return size
    return 0
