"""SLO-aware admission: refuse a request at once when it would miss its TTFT target anyway.

Past saturation, a queue that accepts everything makes *every* request late: each new arrival
waits behind all the others. Refusing the surplus at the door (RESOURCE_EXHAUSTED, HTTP 429,
with a retry-after hint) keeps the admitted requests within the SLO and costs the refused ones
a fast answer instead of a slow timeout. The in-flight cap (gateway.limits.InflightLimit) stays
the hard bound under this.

The prediction. A request waits for the prefill work admitted before it (the gateway has no
queue of its own: all of it queues on the prefill workers) and then for its own prefill. Per
routable prefill worker W, with R requests admitted and not yet at their first token holding P
prompt tokens, a new request of n tokens sees

    r = (R + 1) / W   requests ahead of and including it, per worker
    x = (P + n) / W   prompt tokens ahead of and including it, per worker
    d = D             admitted requests past their first token (decoding), which share the
                      machine's memory bandwidth or, on CPUs, its cores with prefill
    predicted TTFT = c + a * r + b * x + e * d + margin

where (c, a, b, e) >= 0 are fitted by least squares to the last `window` admitted requests' own
(r, x, d) at admission and the TTFT they then saw (admission to first token, measured here: the flow calls
`Admitted.first_token()`). The same features at prediction and at fitting keep the model honest
about batching: when the workers batch well, TTFT grows slowly with r and the fit says so. Every
step time, gRPC hop and kvstore lookup is inside the measured TTFT. The fit predicts the mean; the
SLO is about the tail, so `margin` is the `quantile` (0.9) of the fit's residuals over the same
window: on a noisy machine the gateway admits less, on a quiet one nearly up to the mean.

    predicted > SLO  ->  RESOURCE_EXHAUSTED "predicted TTFT 840 ms exceeds the SLO of 500 ms ...",
                         retry-after = predicted - SLO: the queue ahead drains one second per second,
                         so by then a request like this one would fit

Learning: until `min_samples` requests have reported a first token there is no model; up to
`learning_queue` requests per worker are admitted meanwhile, more are refused (retry-after 1 s)
rather than accepted blind.

Configuration: off by default (a shared CI machine's TTFT varies too much for a default target to
be safe); `--admission-ttft-slo-ms MS` (or PDSERVE_ADMISSION_TTFT_SLO_MS), part of the gateway's
config, turns it on (`admission_for`). A sensible target is the SLO monitor's
(--slo-ttft-p99-ms / PDSERVE_SLO_TTFT_P99_MS) or a little under it. See docs/overload.md.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import combinations

import grpc
import numpy as np
from prometheus_client import Counter, Gauge

from gateway.limits import Admitted, InflightLimit
from pdserve.grpc_server import ServiceError

Features = tuple[float, float, float]  # (r, x, d): see the module docstring
REJECTED = Counter("pdserve_admission_rejected_total", "Requests refused by SLO-aware admission", ["reason"])
PREDICTED_TTFT = Gauge("pdserve_admission_predicted_ttft_seconds", "TTFT predicted for the last arrival")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    ttft_slo_s: float  # refuse when the predicted TTFT exceeds this
    min_samples: int = 8  # first tokens seen before the model is trusted
    learning_queue: int = 4  # requests per worker admitted while learning
    window: int = 256  # the fit uses the last this many requests...
    max_age_s: float = 60.0  # ...that reported within this many seconds
    refit_interval_s: float = 0.1  # refit at most this often (it is cheap, but not free)
    quantile: float = 0.9  # of the residuals: the margin added to the fitted mean

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0:
            raise ValueError(f"the admission TTFT SLO must be positive, got {self.ttft_slo_s * 1000:g} ms")
        if self.min_samples < 1 or self.learning_queue < 1 or self.window < self.min_samples:
            raise ValueError("need min_samples >= 1, learning_queue >= 1 and window >= min_samples")
        if not 0 <= self.quantile < 1:
            raise ValueError(f"quantile must be in [0, 1), got {self.quantile}")


@dataclass(slots=True)
class TtftModel:
    """predicted TTFT = c + a*r + b*x + e*d + margin: non-negative least squares over a window of
    observations of (r, x, d) -> TTFT, plus the `quantile` of its residuals."""

    window: int = 256
    max_age_s: float = 60.0
    quantile: float = 0.9
    _samples: deque[tuple[float, Features, float]] = field(default_factory=deque)  # (time, (r, x, d), ttft)
    coef: tuple[float, ...] | None = None  # (c, a, b, e); None until fitted
    margin: float = 0.0  # seconds added to the fitted mean
    dirty: bool = False

    def observe(self, now: float, features: Features, ttft_s: float) -> None:
        self._samples.append((now, features, ttft_s))
        while len(self._samples) > self.window:
            self._samples.popleft()
        self.dirty = True

    def __len__(self) -> int:
        return len(self._samples)

    def fit(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.max_age_s:
            self._samples.popleft()
        self.dirty = False
        if not self._samples:
            self.coef = None
            return
        data = np.array([(1.0, *f, y) for _, f, y in self._samples])  # [N, 1 + features + 1]
        self.coef = nonnegative_fit(data[:, :-1], data[:, -1])
        residuals = data[:, -1] - data[:, :-1] @ np.asarray(self.coef)
        self.margin = max(0.0, float(np.quantile(residuals, self.quantile)))

    def predict(self, features: Features) -> float | None:
        if self.coef is None:
            return None
        return float(np.dot(self.coef, (1.0, *features))) + self.margin


def nonnegative_fit(features: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least-squares coefficients >= 0: the best fit over the subsets of columns whose unconstrained
    fit has no negative coefficient (exact for a handful of columns: it tries every subset). Collinear columns share the weight
    (lstsq's minimum-norm solution), which is what a prediction along the same line needs."""
    n = features.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(n, 0, -1):
        for cols in combinations(range(n), size):
            sub = features[:, cols]
            solution = np.linalg.lstsq(sub, y, rcond=None)[0]
            if (solution < 0).any():
                continue
            residual = float(((sub @ solution - y) ** 2).sum())
            if best is None or residual < best[0] * (1 - 1e-9) - 1e-15:
                full = np.zeros(n)
                full[list(cols)] = solution
                best = (residual, full)
    return tuple(float(v) for v in best[1]) if best is not None else (0.0,) * n


class _Ticket(Admitted):
    """One admitted request: counted as pending prefill work until its first token."""

    def __init__(self, owner: "SloAdmission", features: Features, tokens: int, start: float) -> None:
        self.owner, self.features, self.tokens, self.start = owner, features, tokens, start
        self.pending = True

    def first_token(self) -> None:
        if self.pending:
            self.owner._done(self, observed=True)

    def leave(self) -> None:
        if self.pending:  # failed or cancelled before its first token: no observation
            self.owner._done(self, observed=False)


class SloAdmission:
    """Admits a request when its predicted TTFT is within the SLO; see the module docstring.

    `cap` is the gateway's hard in-flight bound (shared by every deployment); `workers` tells how
    many prefill workers can take requests now (the pool's `routable_count`)."""

    def __init__(self, cap: InflightLimit, config: AdmissionConfig, workers: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.config = config
        self._workers = workers
        self._clock = clock
        self.model = TtftModel(config.window, config.max_age_s, config.quantile)
        self.admitted = 0  # requests admitted and not finished
        self.pending_requests = 0  # ...of which not yet at their first token
        self.pending_tokens = 0
        self._last_fit = -math.inf

    @contextmanager
    def admit(self, prompt_tokens: int = 0) -> Iterator[Admitted]:
        """Hold a slot of `cap` for the block if the predicted TTFT is within the SLO; ServiceError
        RESOURCE_EXHAUSTED with `retry_after_s` otherwise."""
        features = self.features(prompt_tokens)
        self.check(features)
        with self.cap.hold():
            ticket = _Ticket(self, features, prompt_tokens, self._clock())
            self.admitted += 1
            self.pending_requests += 1
            self.pending_tokens += prompt_tokens
            try:
                yield ticket
            finally:
                ticket.leave()
                self.admitted -= 1

    def features(self, prompt_tokens: int) -> Features:
        """(r, x, d) of a new request of `prompt_tokens` tokens: see the module docstring."""
        workers = max(1, self._workers())
        return ((self.pending_requests + 1) / workers, (self.pending_tokens + prompt_tokens) / workers,
                float(self.admitted - self.pending_requests))

    def predict(self, features: Features) -> float | None:
        """Predicted TTFT in seconds; None while learning."""
        now = self._clock()
        if self.model.dirty and now - self._last_fit >= self.config.refit_interval_s:
            self.model.fit(now)
            self._last_fit = now
        if len(self.model) < self.config.min_samples:
            return None
        return self.model.predict(features)

    def check(self, features: Features) -> None:
        """Raise RESOURCE_EXHAUSTED when a request with these features should be refused."""
        c = self.config
        predicted = self.predict(features)
        r = features[0]
        if predicted is None:
            if r > c.learning_queue:
                REJECTED.labels(reason="learning").inc()
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"gateway is still learning its prefill speed ({len(self.model)} of "
                                   f"{c.min_samples} requests measured) and already has {r - 1:g} requests "
                                   "waiting per prefill worker; retry in 1 s", retry_after_s=1.0)
            return
        PREDICTED_TTFT.set(predicted)
        if predicted > c.ttft_slo_s:
            REJECTED.labels(reason="slo").inc()
            wait = predicted - c.ttft_slo_s
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"predicted time to first token {predicted * 1000:.0f} ms exceeds the SLO of "
                               f"{c.ttft_slo_s * 1000:.0f} ms ({self.pending_requests} requests waiting for "
                               f"prefill); retry after {wait:.2f} s", retry_after_s=wait)

    def _done(self, ticket: _Ticket, observed: bool) -> None:
        ticket.pending = False
        self.pending_requests -= 1
        self.pending_tokens -= ticket.tokens
        if observed:
            now = self._clock()
            self.model.observe(now, ticket.features, now - ticket.start)


def admission_for(cap: InflightLimit, prefill_routable: Callable[[], int],
                  slo_ms: float = 0.0) -> InflightLimit | SloAdmission:
    """What a deployment's flow admits through: `cap` alone when admission is off (`slo_ms` 0,
    the gateway's --admission-ttft-slo-ms), else SLO-aware admission under `cap`."""
    if slo_ms <= 0:
        return cap
    return SloAdmission(cap, AdmissionConfig(ttft_slo_s=slo_ms / 1000), prefill_routable)
