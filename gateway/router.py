"""Routing policy: which worker of a pool gets the next request.

A pure function of documented inputs so that it can be tested alone and replaced (a later
issue adds prefix-aware routing, which will also take the prompt's block hashes and what each
worker holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the policy knows of one worker."""

    address: str
    healthy: bool  # last health probe said SERVING and no call has seen it UNAVAILABLE since
    inflight: int  # requests this gateway has on it right now


def pick_least_loaded(candidates: Sequence[Candidate], cursor: int) -> int | None:
    """Index of the healthy candidate with the fewest in-flight requests, None if none is healthy.

    Ties go round-robin: the tied candidate at or after position `cursor` (wrapping around) wins,
    and the caller moves its cursor past the winner, so equal workers take turns.
    """
    healthy = [i for i, c in enumerate(candidates) if c.healthy]
    if not healthy:
        return None
    least = min(candidates[i].inflight for i in healthy)
    tied = [i for i in healthy if candidates[i].inflight == least]
    start = cursor % len(candidates)
    return next((i for i in tied if i >= start), tied[0])
