"""SLO monitor: P99 TTFT over a sliding window against a threshold, and the signal a scaler reads.

Every request's TTFT goes in (`observe_ttft`); `evaluate` (at most once per `eval_interval_s` from
observations, and from a periodic tick so that a quiet gateway still recovers) computes the window's
P99 and:
  * on a breach (P99 > threshold, with at least `min_samples` in the window), logs one warning and
    sets pdserve_slo_breach{slo="ttft_p99"} to 1; no further warnings until it has recovered;
  * on recovery (P99 <= threshold, or the window emptied), logs once and sets it back to 0;
  * always publishes pdserve_slo_ttft_p99_seconds (the window's P99) and
    pdserve_slo_desired_replicas_hint: how many prefill replicas would bring P99 under the threshold
    if TTFT scaled inversely with replicas (ceil(replicas * p99 / threshold), at most doubling per
    evaluation; one fewer when P99 is under a third of the threshold; never below 1). An
    autoscaler (KEDA, HPA on external metrics) reads that gauge; the gateway never scales itself.

Configuration: `SloConfig`, part of the gateway's config: --slo-ttft-p99-ms / PDSERVE_SLO_TTFT_P99_MS
(default 250), --slo-window-s / PDSERVE_SLO_WINDOW_S (60), --slo-min-samples /
PDSERVE_SLO_MIN_SAMPLES (20). The clock is injectable for tests.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import Gauge

from pdserve.config_flags import build, setting

log = logging.getLogger(__name__)

SLO_NAME = "ttft_p99"
SLO_BREACH = Gauge("pdserve_slo_breach", "1 while the SLO is breached, else 0", ["slo"])
SLO_TTFT_P99 = Gauge("pdserve_slo_ttft_p99_seconds", "P99 TTFT over the SLO monitor's sliding window")
SLO_TTFT_THRESHOLD = Gauge("pdserve_slo_ttft_p99_threshold_seconds", "The P99 TTFT the gateway aims for")
DESIRED_REPLICAS = Gauge("pdserve_slo_desired_replicas_hint",
                         "Prefill replicas that would meet the TTFT SLO (a hint for an autoscaler)")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, interpolated linearly as numpy's default."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


@dataclass(frozen=True, slots=True)
class SloConfig:
    """The SLO the monitor watches (module docstring); --help: each field's text."""

    threshold_s: float = setting(0.250, "P99 time to first token the gateway aims for (the SLO monitor's "
                                 "threshold)", flag="--slo-ttft-p99-ms", env="PDSERVE_SLO_TTFT_P99_MS", scale=1e3,
                                 metavar="MS")
    window_s: float = setting(60.0, "seconds of TTFTs the SLO monitor's P99 covers", flag="--slo-window-s",
                              env="PDSERVE_SLO_WINDOW_S", metavar="S")
    min_samples: int = setting(20, "TTFTs in the window before the SLO monitor judges it", flag="--slo-min-samples",
                               env="PDSERVE_SLO_MIN_SAMPLES", metavar="N")
    eval_interval_s: float = setting(1.0, "re-evaluate at most this often", flag=None)

    def __post_init__(self) -> None:
        if not self.threshold_s > 0:  # also refuses NaN
            raise ValueError(f"--slo-ttft-p99-ms / PDSERVE_SLO_TTFT_P99_MS must be > 0, got {self.threshold_s * 1e3:g}")
        if not self.window_s > 0:
            raise ValueError(f"--slo-window-s / PDSERVE_SLO_WINDOW_S must be > 0 seconds, got {self.window_s:g}")
        if self.min_samples < 1:
            raise ValueError(f"--slo-min-samples / PDSERVE_SLO_MIN_SAMPLES must be >= 1, got {self.min_samples}")
        if not self.eval_interval_s >= 0:
            raise ValueError(f"eval_interval_s must be >= 0, got {self.eval_interval_s:g}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SloConfig:
        """The config of the PDSERVE_SLO_* variables of `env` (no flags)."""
        return build(cls, None, env)


@dataclass(frozen=True, slots=True)
class SloState:
    p99_s: float | None  # None: no samples in the window
    samples: int
    breached: bool
    desired_replicas: int


class SloMonitor:
    """Sliding-window P99 TTFT against a threshold; see the module docstring."""

    def __init__(self, config: SloConfig | None = None, replicas: Callable[[], int] = lambda: 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or SloConfig()
        self._replicas = replicas
        self._clock = clock
        self._samples: deque[tuple[float, float]] = deque()  # (time, ttft seconds), oldest first
        self._last_eval = -math.inf
        self.breached = False
        self.state = SloState(None, 0, False, max(1, replicas()))
        SLO_TTFT_THRESHOLD.set(self.config.threshold_s)
        SLO_BREACH.labels(slo=SLO_NAME).set(0)

    def observe_ttft(self, seconds: float) -> None:
        now = self._clock()
        self._samples.append((now, seconds))
        if now - self._last_eval >= self.config.eval_interval_s:
            self.evaluate()

    def evaluate(self) -> SloState:
        """Recompute the window's P99 and move the breach state; returns the new state."""
        now = self._clock()
        self._last_eval = now
        cutoff = now - self.config.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        values = sorted(v for _, v in self._samples)
        p99 = percentile(values, 99) if values else None
        if p99 is None:
            self._set_breached(False, None, 0)
        elif len(values) >= self.config.min_samples:
            self._set_breached(p99 > self.config.threshold_s, p99, len(values))
        # else: too few samples to judge; keep the current state
        replicas = max(1, self._replicas())
        self.state = SloState(p99, len(values), self.breached, self._desired(replicas, p99))
        SLO_TTFT_P99.set(p99 or 0.0)
        DESIRED_REPLICAS.set(self.state.desired_replicas)
        return self.state

    def _desired(self, replicas: int, p99: float | None) -> int:
        threshold = self.config.threshold_s
        if p99 is None:
            return replicas
        if self.breached:
            return min(2 * replicas, max(replicas + 1, math.ceil(replicas * p99 / threshold)))
        if p99 < threshold / 3 and replicas > 1:
            return replicas - 1
        return replicas

    def _set_breached(self, breached: bool, p99: float | None, samples: int) -> None:
        if breached == self.breached:
            return
        self.breached = breached
        SLO_BREACH.labels(slo=SLO_NAME).set(1 if breached else 0)
        threshold_ms = self.config.threshold_s * 1000
        if breached:
            log.warning("SLO breach: P99 TTFT %.1f ms over the last %g s (%d requests) exceeds %.0f ms",
                        (p99 or 0) * 1000, self.config.window_s, samples, threshold_ms)
        else:
            shown = f"{p99 * 1000:.1f} ms" if p99 is not None else "no traffic"
            log.warning("SLO recovered: P99 TTFT %s over the last %g s is within %.0f ms",
                        shown, self.config.window_s, threshold_ms)
