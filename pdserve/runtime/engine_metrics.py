"""Prometheus metrics of a worker's engine (prefill and decode alike), recorded by AsyncEngine.

On the WORKER registry (pdserve.metric_registries), defined once per process (a process runs one
engine; tests that run several share the series, which only makes the gauges "last writer wins").
Step time and batch size are observed once per engine step; the gauges are refreshed once per
engine loop turn, so they also follow aborts and arrivals that happen between steps. Preemptions
and prefix-cache lookups are counted where they happen (the scheduler, the block manager), by
calling `count_preemptions` and `count_prefix_lookup`. Cost: a few microseconds a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from pdserve.metric_registries import WORKER

if TYPE_CHECKING:  # engine.py, scheduler.py and block_manager.py call in here: no import cycle
    from pdserve.runtime.engine import Engine

# Millisecond-resolving buckets: a step of stories260K takes ~1 ms, a large model's ~100 ms.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

STEP_SECONDS = Histogram("pdserve_engine_step_seconds", "Duration of one engine step (schedule, forward, sample)",
                         buckets=STEP_BUCKETS, registry=WORKER)
BATCH_SIZE = Histogram("pdserve_engine_batch_size", "Sequences scheduled in one engine step",
                       buckets=BATCH_BUCKETS, registry=WORKER)
QUEUE_SECONDS = Histogram("pdserve_engine_queue_seconds",
                          "From a request entering the engine to the start of the step that produced its "
                          "first token (waiting + earlier prefill chunks)", buckets=QUEUE_BUCKETS, registry=WORKER)
RUNNING = Gauge("pdserve_engine_running_seqs", "Sequences in the running batch", registry=WORKER)
WAITING = Gauge("pdserve_engine_waiting_seqs", "Sequences waiting to be scheduled", registry=WORKER)
KV_BLOCKS_USED = Gauge("pdserve_kv_blocks_used", "KV blocks of the paged cache held by sequences or pins",
                       registry=WORKER)
KV_BLOCKS_FREE = Gauge("pdserve_kv_blocks_free", "KV blocks of the paged cache free for allocation "
                       "(evictable cached blocks included)", registry=WORKER)
# As vllm:kv_cache_usage_perc (a 0..1 fraction despite the name): 1 - free / total.
KV_CACHE_USAGE = Gauge("pdserve_kv_cache_usage_ratio", "Fraction of the paged KV cache's blocks in use (0..1)",
                       registry=WORKER)
PREEMPTIONS = Counter("pdserve_engine_preemptions_total",
                      "Running sequences preempted (blocks dropped, recomputed later) for want of KV blocks",
                      registry=WORKER)
# As vllm:prefix_cache_queries / vllm:prefix_cache_hits: prompt tokens looked up in this worker's
# paged cache and those found there; their rate ratio is the prefix-cache hit rate.
PREFIX_CACHE_QUERIES = Counter("pdserve_prefix_cache_queries_total",
                               "Prompt tokens looked up in the worker's prefix cache", registry=WORKER)
PREFIX_CACHE_HITS = Counter("pdserve_prefix_cache_hits_total",
                            "Prompt tokens whose KV the worker's prefix cache held", registry=WORKER)
# Speculative decoding (pdserve.runtime.speculative), as vLLM's vllm:spec_decode_num_*_tokens_total.
SPEC_DRAFTS = Counter("pdserve_spec_decode_draft_tokens_total", "Draft tokens proposed and verified",
                      registry=WORKER)
SPEC_ACCEPTED = Counter("pdserve_spec_decode_accepted_tokens_total", "Draft tokens the verification accepted",
                        registry=WORKER)


def observe_step(seconds: float, batch_size: int) -> None:
    """One finished step that ran `batch_size` sequences."""
    STEP_SECONDS.observe(seconds)
    BATCH_SIZE.observe(batch_size)


def observe_queue(seconds: float) -> None:
    QUEUE_SECONDS.observe(seconds)


def count_preemptions(n: int = 1) -> None:
    """`n` running sequences were preempted (called by the scheduler as it drops their blocks)."""
    PREEMPTIONS.inc(n)


def count_prefix_lookup(prompt_tokens: int, hit_tokens: int) -> None:
    """A sequence's prompt was looked up in the prefix cache: `hit_tokens` of its `prompt_tokens`
    were there (called by the block manager when it allocates the sequence's blocks)."""
    PREFIX_CACHE_QUERIES.inc(prompt_tokens)
    PREFIX_CACHE_HITS.inc(hit_tokens)


def count_speculation(draft_tokens: int, accepted_tokens: int) -> None:
    """One sequence's draft verified: `accepted_tokens` of its `draft_tokens` kept (engine thread)."""
    SPEC_DRAFTS.inc(draft_tokens)
    SPEC_ACCEPTED.inc(accepted_tokens)


def refresh_gauges(engine: Engine) -> None:
    """Running/waiting sequences and KV blocks as the engine holds them now (engine thread only)."""
    scheduler, bm = engine.scheduler, engine.block_manager
    RUNNING.set(len(scheduler.running))
    WAITING.set(len(scheduler.waiting))
    free, total = bm.num_free_blocks, bm.num_blocks
    KV_BLOCKS_FREE.set(free)
    KV_BLOCKS_USED.set(total - free)
    KV_CACHE_USAGE.set((total - free) / total if total else 0.0)


def last_batch_size(counts_before: dict[int, int], counts_after: dict[int, int]) -> int:
    """The batch size the engine recorded in its last step: the size whose count went up (0: no step)."""
    for size, count in counts_after.items():
        if count != counts_before.get(size, 0):
            return size
    return 0
