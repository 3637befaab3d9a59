"""gateway.slo: sliding-window P99 TTFT against a threshold, driven by an injected clock."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client import REGISTRY

from gateway.slo import SloConfig, SloMonitor, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.mark.parametrize("values", [[5.0], [1.0, 2.0], list(range(100)), [0.3, 0.01, 0.2, 0.25, 7.0, 0.11, 0.4]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_interpolation(values: list[float], q: float) -> None:
    assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, q)))


def monitor(clock: Clock, replicas: int = 2, **overrides) -> SloMonitor:
    config = SloConfig(**{"threshold_s": 0.250, "window_s": 10.0, "min_samples": 20, "eval_interval_s": 0.0,
                          **overrides})
    return SloMonitor(config, replicas=lambda: replicas, clock=clock)


def test_breach_warns_once_sets_gauges_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    slo = monitor(clock)
    caplog.set_level(logging.WARNING, logger="gateway.slo")
    for _ in range(100):  # healthy traffic: 100 ms
        slo.observe_ttft(0.100)
        clock.now += 0.01
    assert not slo.breached and gauge("pdserve_slo_breach", slo="ttft_p99") == 0
    assert gauge("pdserve_slo_ttft_p99_seconds") == pytest.approx(0.100)

    for _ in range(20):  # 20 slow requests out of 120: the window's P99 is 900 ms
        slo.observe_ttft(0.900)
        clock.now += 0.01
    window = [0.1] * 100 + [0.9] * 20
    assert slo.breached and gauge("pdserve_slo_breach", slo="ttft_p99") == 1
    assert gauge("pdserve_slo_ttft_p99_seconds") == pytest.approx(np.percentile(window, 99))
    # 2 replicas at P99 900 ms vs 250 ms: ceil(2 * 3.6) = 8, capped at doubling
    assert slo.state.desired_replicas == 4 and gauge("pdserve_slo_desired_replicas_hint") == 4
    breaches = [r for r in caplog.records if "SLO breach" in r.getMessage()]
    assert len(breaches) == 1  # once per breach, not once per slow request

    clock.now += 11.0  # the slow requests leave the window
    for _ in range(30):
        slo.observe_ttft(0.050)
    assert not slo.breached and gauge("pdserve_slo_breach", slo="ttft_p99") == 0
    assert sum("SLO recovered" in r.getMessage() for r in caplog.records) == 1
    # 50 ms is under a third of 250 ms: one replica fewer would do
    assert slo.state.desired_replicas == 1

    for _ in range(30):  # a second breach warns again
        slo.observe_ttft(2.0)
    assert slo.breached
    assert sum("SLO breach" in r.getMessage() for r in caplog.records) == 2


def test_too_few_samples_do_not_decide() -> None:
    clock = Clock()
    slo = monitor(clock, min_samples=20)
    for _ in range(19):
        slo.observe_ttft(5.0)
    assert not slo.breached  # 19 slow requests are not yet a P99
    slo.observe_ttft(5.0)
    assert slo.breached


def test_quiet_gateway_recovers_on_tick() -> None:
    clock = Clock()
    slo = monitor(clock)
    for _ in range(25):
        slo.observe_ttft(1.0)
    assert slo.breached
    clock.now += 10.5  # no traffic at all; the periodic evaluate empties the window
    state = slo.evaluate()
    assert state.p99_s is None and state.samples == 0 and not slo.breached
    assert gauge("pdserve_slo_breach", slo="ttft_p99") == 0


def test_evaluation_is_throttled_between_ticks() -> None:
    clock = Clock()
    slo = monitor(clock, eval_interval_s=1.0, min_samples=1)
    slo.observe_ttft(0.01)  # evaluates (first observation)
    slo.observe_ttft(9.0)  # within the interval: not evaluated yet
    assert not slo.breached
    clock.now += 1.0
    slo.observe_ttft(9.0)
    assert slo.breached


def test_threshold_from_environment() -> None:
    config = SloConfig.from_env({"PDSERVE_SLO_TTFT_P99_MS": "400", "PDSERVE_SLO_WINDOW_S": "30"})
    assert config.threshold_s == pytest.approx(0.4) and config.window_s == 30
    assert SloConfig.from_env({"PDSERVE_SLO_WINDOW_S": "30"}).threshold_s == pytest.approx(0.25)  # the default
