"""Routing policy: which worker of a pool gets the next request.

Pure functions of documented inputs so that they can be tested alone and replaced:
`pick_least_loaded` (prefill workers) and `pick_decode`, the KV-aware choice of a decode worker
by `decode_cost`, which credits prompt blocks already resident on a worker and the session's
last worker against the worker's load and KV pressure (see `RoutingWeights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the policy knows of one worker."""

    address: str
    healthy: bool  # routable: last probe said SERVING, no call has seen it UNAVAILABLE since, breaker not open
    inflight: int  # requests this gateway has on it right now


SESSION_SLACK = 2  # a session's prefill stays home while home is at most this many requests busier


def pick_least_loaded(candidates: Sequence[Candidate], cursor: int, home: int | None = None,
                      home_slack: int = SESSION_SLACK) -> int | None:
    """Index of the healthy candidate with the fewest in-flight requests, None if none is healthy.

    Ties go round-robin: the tied candidate at or after position `cursor` (wrapping around) wins,
    and the caller moves its cursor past the winner, so equal workers take turns.
    `home` (a session's last prefill worker, whose paged cache holds the conversation so far and
    was sent the session's prefetch) wins while it is healthy and at most `home_slack` requests
    busier than the least loaded: computing the history again elsewhere costs more than that wait.
    """
    healthy = [i for i, c in enumerate(candidates) if c.healthy]
    if not healthy:
        return None
    least = min(candidates[i].inflight for i in healthy)
    if home is not None and home in healthy and candidates[home].inflight <= least + home_slack:
        return home
    tied = [i for i in healthy if candidates[i].inflight == least]
    start = cursor % len(candidates)
    return next((i for i in tied if i >= start), tied[0])


# ---- KV-aware choice of the decode worker ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeCandidate:
    """What the KV-aware policy knows of one decode worker (all counts in requests or KV blocks)."""

    address: str
    healthy: bool
    inflight: int  # requests this gateway has on it right now
    running: int = 0  # sequences in its running batch (last Stats poll; 0 if unknown)
    free_blocks: int = 0  # free + evictable KV blocks (last Stats poll)
    total_blocks: int = 0  # 0 = unknown: the KV terms are left out
    resident_prefix_blocks: int = 0  # leading blocks of this prompt already in its paged cache
    session_home: bool = False  # the request's session last ran here


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    """Weights of `decode_cost`, in units of "one more request in flight".

    load: per request in flight (the gateway's own count, or the worker's running batch when that
      is larger: other gateways' requests count too).
    kv_pressure: multiplied by the fraction of KV blocks in use; a full cache costs this much (it
      will preempt or refuse, which hurts everyone on it).
    prefix_block: credit per leading prompt block already resident. 1/16 means 16 blocks (256
      tokens at block size 16) that need no transfer and no import are worth one request of load.
    session: credit for the worker the session last ran on (its write-back blocks and whatever
      else of the conversation is cached there): a session stays while that worker is at most
      this many requests busier than the best other choice.
    no_room: penalty when the worker cannot even hold the request's blocks.
    """

    load: float = 1.0
    kv_pressure: float = 4.0
    prefix_block: float = 1.0 / 16
    session: float = 2.0
    no_room: float = 1000.0


DEFAULT_WEIGHTS = RoutingWeights()


def decode_cost(c: DecodeCandidate, blocks_needed: int, w: RoutingWeights = DEFAULT_WEIGHTS) -> float:
    """Cost of sending a request needing `blocks_needed` KV blocks to `c`; lower is better."""
    cost = w.load * max(c.inflight, c.running)
    if c.total_blocks > 0:
        cost += w.kv_pressure * (1.0 - c.free_blocks / c.total_blocks)
        missing = blocks_needed - c.resident_prefix_blocks
        if missing > c.free_blocks:
            cost += w.no_room
    cost -= w.prefix_block * c.resident_prefix_blocks
    if c.session_home:
        cost -= w.session
    return cost


def pick_decode(candidates: Sequence[DecodeCandidate], blocks_needed: int, cursor: int,
                weights: RoutingWeights = DEFAULT_WEIGHTS) -> int | None:
    """Index of the healthy candidate of least `decode_cost`, None if none is healthy; ties go
    round-robin from `cursor` as in `pick_least_loaded`."""
    healthy = [i for i, c in enumerate(candidates) if c.healthy]
    if not healthy:
        return None
    costs = {i: decode_cost(candidates[i], blocks_needed, weights) for i in healthy}
    best = min(costs.values())
    tied = [i for i in healthy if costs[i] <= best + 1e-9]
    start = cursor % len(candidates)
    return next((i for i in tied if i >= start), tied[0])
