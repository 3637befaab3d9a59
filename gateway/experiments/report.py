"""What `pdserve experiment report` shows per arm, and the statistics behind it.

`ArmReport` is the protobuf-free row (the gRPC servicer converts it at the edge). The reward's 95%
confidence interval is the normal approximation, mean +- 1.96 * s / sqrt(n) with the sample
standard deviation s: rewards are bounded in [0, 1], so it is fair from a few dozen requests on,
and 0 wide below two. Latency percentiles are nearest-rank over a bounded window of recent requests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

Z_95 = 1.959964


@dataclass(frozen=True)
class ArmReport:
    """One arm of one experiment, as the report prints it."""

    experiment: str
    arm: str
    policy: str
    requests: int
    share: float  # of the experiment's requests
    rewarded: int  # requests with a reward
    reward_mean: float
    reward_ci95: float  # half-width
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    errors: int
    feedback: int
    allocation: float  # the policy's intended share of the next request
    up: bool


@dataclass
class RewardMoments:
    """Count, sum and sum of squares of an arm's rewards; a reward may be replaced (feedback)."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.squares += value * value

    def replace(self, old: float, new: float) -> None:
        self.total += new - old
        self.squares += new * new - old * old

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def ci95(self) -> float:
        """Half-width of the normal-approximation 95% interval of the mean (0 below 2 rewards)."""
        if self.n < 2:
            return 0.0
        variance = max(self.squares - self.n * self.mean ** 2, 0.0) / (self.n - 1)
        return Z_95 * math.sqrt(variance / self.n)


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank q-th percentile (q in [0, 100]) of `samples`; 0 when there are none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(math.ceil(q / 100.0 * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass
class ArmRecord:
    """What the gateway observed of one arm: counts, rewards and recent latencies."""

    window: int = 10_000  # latency samples kept for the percentiles
    requests: int = 0
    errors: int = 0
    feedback: int = 0
    rewards: RewardMoments = field(default_factory=RewardMoments)
    ttft_s: deque[float] = field(init=False)
    tpot_s: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.ttft_s = deque(maxlen=self.window)
        self.tpot_s = deque(maxlen=self.window)
