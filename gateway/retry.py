"""Retry budget and backoff: retries help with one bad worker and must never become a retry storm.

When workers fail because they are overloaded, retrying every failed call multiplies the load
that made them fail. The budget (as Finagle's and gRPC's retry throttling) caps retries at a
fraction of the requests seen over a sliding window, plus a small floor so that a quiet gateway
can still retry: over the last `window_s` seconds,

    retries  <=  min_retries + ratio * requests

A retry that would exceed it is not made; the caller reports the original failure instead.
`WorkerPool.retry_allowed()` owns one budget per pool; `WorkerPool.pick(exclude=...)` with a
non-empty `exclude` is a retry and consults it (see gateway.workers). For retries to the *same*
place (a resumed stream, a reconnect), wait `backoff_s(attempt)` first: exponential with full
jitter, so that clients failed by the same event spread their retries out.

Configuration: PDSERVE_RETRY_RATIO (0.1), PDSERVE_RETRY_MIN (3 per window), PDSERVE_RETRY_WINDOW_S (10).
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    ratio: float = 0.1  # retries allowed per request over the window
    min_retries: int = 3  # retries allowed per window regardless of traffic
    window_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"retry ratio must be in [0, 1], got {self.ratio}")
        if self.min_retries < 0 or self.window_s <= 0:
            raise ValueError("need min_retries >= 0 and window_s > 0")

    @classmethod
    def from_env(cls) -> "RetryBudgetConfig":
        env = os.environ.get
        return cls(ratio=float(env("PDSERVE_RETRY_RATIO", "0.1")), min_retries=int(env("PDSERVE_RETRY_MIN", "3")),
                   window_s=float(env("PDSERVE_RETRY_WINDOW_S", "10")))


class RetryBudget:
    """Counts requests and retries over a sliding window; `try_retry` spends from the budget."""

    def __init__(self, config: RetryBudgetConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RetryBudgetConfig()
        self._clock = clock
        self._requests: deque[float] = deque()  # arrival times, oldest first
        self._retries: deque[float] = deque()
        self.denied = 0  # retries refused so far (for tests and logs)

    def record_request(self) -> None:
        """A first attempt (not a retry) was made."""
        self._requests.append(self._clock())

    def try_retry(self) -> bool:
        """True (and the retry is counted) when the budget allows one more retry now."""
        now = self._clock()
        self._expire(now)
        c = self.config
        if len(self._retries) + 1 > c.min_retries + c.ratio * len(self._requests):
            self.denied += 1
            return False
        self._retries.append(now)
        return True

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.window_s
        for times in (self._requests, self._retries):
            while times and times[0] < cutoff:
                times.popleft()


def backoff_s(attempt: int, base_s: float = 0.05, cap_s: float = 2.0, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1, 2, ...): uniform(0, min(cap, base * 2^(attempt-1)))
    ("full jitter")."""
    if attempt < 1:
        raise ValueError(f"attempt counts from 1, got {attempt}")
    return (rng or random).uniform(0.0, min(cap_s, base_s * 2 ** (attempt - 1)))
