"""Per-API-key limits: a token bucket for the request rate and a cap on requests in flight.

Each key of the keys file may carry `rate=5/s burst=10 concurrency=4` (`KeyLimits.parse`); its
`KeyLimiter` admits a request when the bucket has a token and fewer than `concurrency` of the
key's requests are running, and otherwise raises `KeyLimitExceeded` with how long to wait
(RESOURCE_EXHAUSTED on gRPC, 429 with Retry-After on HTTP). These are fairness limits between
tenants; the gateway-wide overload limits (in-flight cap, SLO admission) are elsewhere and apply
after these. The clock is injected so the bucket is tested without sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

Clock = Callable[[], float]

_PER = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


class KeyLimitExceeded(Exception):
    """A key's request rate or concurrency limit refused a request; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's limits; None = unlimited."""

    rate_per_s: float | None = None  # sustained requests per second
    burst: int = 0  # requests allowed at once on a full bucket (default: the rate per second, at least 1)
    concurrency: int | None = None  # requests in flight at once

    def __post_init__(self) -> None:
        if self.rate_per_s is not None and self.rate_per_s <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate_per_s}")
        if self.burst < 0:
            raise ValueError(f"burst must be >= 1, got {self.burst}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def bucket_size(self) -> int:
        return self.burst or max(1, math.ceil(self.rate_per_s or 1))

    @classmethod
    def parse(cls, options: list[str]) -> KeyLimits:
        """`["rate=5/s", "burst=10", "concurrency=4"]` -> KeyLimits; ValueError naming the bad option."""
        values: dict[str, str] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if not sep or name not in ("rate", "burst", "concurrency") or name in values:
                raise ValueError(f"unknown or repeated option {option!r}; expected rate=N/s, burst=N, concurrency=N")
            values[name] = value
        try:
            return cls(parse_rate(values["rate"]) if "rate" in values else None,
                       int(values.get("burst", 0)),
                       int(values["concurrency"]) if "concurrency" in values else None)
        except ValueError as err:
            raise ValueError(f"bad limit in {' '.join(options)!r}: {err}") from None


def parse_rate(text: str) -> float:
    """Requests per second of "5/s", "120/m", "1000/h" or a bare number (per second)."""
    count, _, per = text.partition("/")
    if per and per not in _PER:
        raise ValueError(f"rate unit must be /s, /m or /h, got {text!r}")
    return float(count) / _PER.get(per or "s", 1.0)


class TokenBucket:
    """Holds up to `size` tokens, refilled at `rate_per_s`; each request takes one."""

    def __init__(self, rate_per_s: float, size: int, clock: Clock = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.size = size
        self._clock = clock
        self._tokens = float(size)
        self._at = clock()

    def take(self) -> float:
        """0 after taking a token; otherwise (nothing taken) the seconds until one is available."""
        now = self._clock()
        self._tokens = min(self.size, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate_per_s


class KeyLimiter:
    """Admits one key's requests within its `KeyLimits`."""

    def __init__(self, name: str, limits: KeyLimits, clock: Clock = time.monotonic) -> None:
        self.name = name
        self.limits = limits
        self.bucket = TokenBucket(limits.rate_per_s, limits.bucket_size, clock) if limits.rate_per_s else None
        self.in_flight = 0

    def acquire(self) -> None:
        """Take one of the key's request slots (give it back with `release`); KeyLimitExceeded when
        the key is at its concurrency limit or its bucket is empty (then nothing is taken)."""
        cap = self.limits.concurrency
        if cap is not None and self.in_flight >= cap:
            raise KeyLimitExceeded(f"API key {self.name!r} already has {cap} requests in flight, its "
                                   f"concurrency limit; wait for one to finish", 1.0)
        wait = self.bucket.take() if self.bucket else 0.0
        if wait > 0:
            raise KeyLimitExceeded(f"API key {self.name!r} is over its rate limit of "
                                   f"{self.limits.rate_per_s:g} requests/s; retry in {wait:.2f} s", wait)
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one of the key's request slots for the block (`acquire` ... `release`)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()
