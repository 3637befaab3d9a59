"""When requests start: Poisson arrivals at a rate, gamma arrivals for burstiness, or all at once.

Inter-arrival times are gamma-distributed with shape `burstiness` and mean 1/rate: shape 1 is
the exponential distribution (a Poisson process), below 1 burstier (a coefficient of variation
of 1/sqrt(shape)), above 1 more regular. An infinite rate starts everything at t=0 (with
--max-concurrency that is a closed loop: each finished request lets the next one in).
"""

from __future__ import annotations

import math

import numpy as np


def start_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` conversations begins (ascending, first at 0)."""
    if n <= 0:
        return []
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_rates(text: str) -> list[float]:
    """"1,2,4,inf" -> [1.0, 2.0, 4.0, inf] (the --sweep flag)."""
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--sweep needs positive request rates separated by commas, got {text!r}")
    return rates
