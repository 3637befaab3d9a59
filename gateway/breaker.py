"""Per-endpoint circuit breaker: stop sending requests to a worker whose calls keep failing.

Health probes (gateway.workers) say whether a worker answers; the breaker says whether its *calls*
succeed. A worker that passes its probe but fails every Prefill (a broken model file, a full disk)
would otherwise keep taking a share of the traffic and failing it.

    closed ──(N consecutive failures, or failure rate over the last calls)──> open
    open ──(cooldown passed)──> half-open: exactly one trial call is let through
    half-open ──trial succeeds──> closed (cooldown back to its base)
    half-open ──trial fails──> open again, with the cooldown doubled (up to a cap)

Cooldowns carry jitter (x uniform(1-j, 1+j)) so that gateways which saw the same failure do not
all send their trial at the same instant. A trial that never reports (its client went away) is
given up after `trial_timeout_s` and another call may try. A worker whose health checks failed
and pass again (restarted, or back from a hang) gets a closed breaker (`reset`): otherwise its
single half-open trial, a long decode stream, would keep every other call from the one worker
left when the other dies. Outcomes come from the RPCs to the
worker (`gateway.worker_calls`): UNAVAILABLE, INTERNAL and UNKNOWN are failures; a refusal the
caller caused (INVALID_ARGUMENT, CANCELLED, DEADLINE_EXCEEDED) or a busy worker
(RESOURCE_EXHAUSTED: admission control handles overload) says nothing about the worker's health.

Configuration: `BreakerConfig` (defaults below; PDSERVE_BREAKER_* environment variables through
`BreakerConfig.from_env`). Clock and random source are injectable for tests.
"""

from __future__ import annotations

import enum
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a breaker opens and how long it stays open."""

    consecutive_failures: int = 5  # this many failures in a row open it
    failure_rate: float = 0.5  # ...or this fraction of failures among the last `window_calls`
    window_calls: int = 20  # (the rate is judged only once the window is full)
    base_cooldown_s: float = 1.0  # open this long after the first opening
    max_cooldown_s: float = 30.0  # doubling per failed trial stops here
    jitter: float = 0.2  # cooldown x uniform(1 - jitter, 1 + jitter)
    trial_timeout_s: float = 10.0  # a half-open trial silent this long lets another call try

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be at least 1, got {self.consecutive_failures}")
        if not 0 < self.failure_rate <= 1:
            raise ValueError(f"failure_rate must be in (0, 1], got {self.failure_rate}")
        if not 0 < self.base_cooldown_s <= self.max_cooldown_s:
            raise ValueError("need 0 < base_cooldown_s <= max_cooldown_s")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    @classmethod
    def from_env(cls) -> "BreakerConfig":
        env = os.environ.get
        return cls(consecutive_failures=int(env("PDSERVE_BREAKER_FAILURES", "5")),
                   base_cooldown_s=float(env("PDSERVE_BREAKER_COOLDOWN_S", "1")),
                   max_cooldown_s=float(env("PDSERVE_BREAKER_MAX_COOLDOWN_S", "30")))


class CircuitBreaker:
    """One endpoint's breaker; see the module docstring for the state machine."""

    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._rng = rng or random.Random()
        self.state = State.CLOSED
        self.opened_count = 0  # openings since it last closed: the cooldown's exponent
        self._consecutive = 0
        self._recent: deque[bool] = deque(maxlen=self.config.window_calls)  # True = failure
        self._reopen_at = 0.0
        self._trial_at: float | None = None  # when the half-open trial was let through

    def available(self) -> bool:
        """Would a call be let through now? (Does not take the half-open trial; see `acquire`.)"""
        if self.state is State.CLOSED:
            return True
        now = self._clock()
        if self.state is State.OPEN:
            return now >= self._reopen_at
        return self._trial_at is None or now - self._trial_at >= self.config.trial_timeout_s

    def acquire(self) -> None:
        """A call was sent through: when the cooldown has passed, it is the half-open trial."""
        if self.state is State.CLOSED or not self.available():
            return
        self.state = State.HALF_OPEN
        self._trial_at = self._clock()

    def record(self, code: grpc.StatusCode | None) -> None:
        """The outcome of one call: None or OK = success; see FAILURE_CODES for what counts as failure."""
        if code is None or code == grpc.StatusCode.OK:
            self._success()
        elif code in FAILURE_CODES:
            self._failure()

    def reset(self) -> None:
        """Closed, as new: for a worker back from the dead (its health checks failed, then passed
        again), whose failed calls were its death and say nothing about the process serving now."""
        self.state, self.opened_count, self._trial_at = State.CLOSED, 0, None
        self._consecutive = 0
        self._recent.clear()

    def seconds_until_trial(self) -> float:
        """How long until this breaker lets a call through (0 when it does now)."""
        if self.state is State.OPEN:
            return max(0.0, self._reopen_at - self._clock())
        return 0.0

    def describe(self) -> str:
        if self.state is State.OPEN:
            return f"circuit open, next trial in {self.seconds_until_trial():.1f} s"
        return f"circuit {self.state.value}"

    def _success(self) -> None:
        self._consecutive = 0
        self._recent.append(False)
        if self.state is State.HALF_OPEN:  # a late success of a call sent before opening proves less
            self.state, self.opened_count, self._trial_at = State.CLOSED, 0, None
            self._recent.clear()

    def _failure(self) -> None:
        self._consecutive += 1
        self._recent.append(True)
        if self.state is State.HALF_OPEN or (self.state is State.CLOSED and self._should_open()):
            self._open()

    def _should_open(self) -> bool:
        c = self.config
        if self._consecutive >= c.consecutive_failures:
            return True
        full = len(self._recent) == c.window_calls
        return full and sum(self._recent) >= c.failure_rate * c.window_calls

    def _open(self) -> None:
        c = self.config
        cooldown = min(c.max_cooldown_s, c.base_cooldown_s * 2 ** self.opened_count)
        cooldown *= self._rng.uniform(1 - c.jitter, 1 + c.jitter)
        self.state, self._trial_at = State.OPEN, None
        self._reopen_at = self._clock() + cooldown
        self.opened_count += 1
