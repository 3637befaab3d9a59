"""Allocation policies: which arm (model deployment) serves the next request of an experiment.

Every policy has the same interface:
  * `choose(rng) -> arm`: the arm for the next request (counts as a pull of that arm);
  * `update(arm, reward)`: a reward in [0, 1] observed for a request that arm served;
    `revise(arm, old, new)` replaces one such reward (late client feedback);
  * `allocation() -> {arm: share}`: the share of traffic each arm gets on the next request, as the
    policy intends it now (it sums to 1 over the arms that are up);
  * `mark_down(arm)` / `mark_up(arm)`: an arm that is down is never chosen until it comes back.

The common decision order in `choose`, shared by all policies (`Policy.choose`):
  1. warm-up: while an arm that is up has fewer than `warmup` pulls, the least-pulled such arm is
     chosen (ties by arm order), so no policy exploits before every arm has `warmup` pulls;
  2. minimum share: with probability `min_share * arms_up` an arm is drawn uniformly, so every arm
     gets at least `min_share` of the traffic in expectation whatever the policy learns;
  3. otherwise the policy's own rule (`_exploit`).
Fixed split honours the minimum share through its weights (each must be >= min_share) instead of
step 2. Everything random goes through the `random.Random` passed to `choose`, so a seeded rng makes
a run reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICY_NAMES = ("fixed", "epsilon_greedy", "ucb1", "thompson")


class NoArmAvailable(RuntimeError):
    """Every arm of the experiment is down."""


@dataclass
class ArmStats:
    """What a policy knows about one arm."""

    pulls: int = 0  # times chosen
    rewards: int = 0  # rewards observed
    reward_sum: float = 0.0

    @property
    def mean(self) -> float:
        """The mean observed reward (0 before any)."""
        return self.reward_sum / self.rewards if self.rewards else 0.0


class Policy:
    """The shared part of every policy: arms, warm-up, minimum share, arms up and down."""

    name = "base"

    def __init__(self, arms: Sequence[str], *, min_share: float = 0.0, warmup: int = 0) -> None:
        arms = list(arms)
        if not arms:
            raise ValueError("a policy needs at least one arm")
        if len(set(arms)) != len(arms):
            raise ValueError(f"arms must be distinct, got {arms}")
        if not 0.0 <= min_share <= 1.0 / len(arms):
            raise ValueError(f"min_share {min_share} must be in [0, 1/{len(arms)}] for {len(arms)} arms")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.arms = arms
        self.min_share = min_share
        self.warmup = warmup
        self.stats = {arm: ArmStats() for arm in arms}
        self._down: set[str] = set()

    # -- arms up and down ------------------------------------------------------------------------

    def active_arms(self) -> list[str]:
        """The arms that are up, in configured order."""
        return [arm for arm in self.arms if arm not in self._down]

    def mark_down(self, arm: str) -> None:
        """Stop choosing `arm` until `mark_up`; its statistics are kept."""
        self._check_arm(arm)
        self._down.add(arm)

    def mark_up(self, arm: str) -> None:
        """Choose `arm` again."""
        self._check_arm(arm)
        self._down.discard(arm)

    # -- the interface ---------------------------------------------------------------------------

    def choose(self, rng: random.Random) -> str:
        """The arm for the next request (warm-up, then minimum share, then the policy's rule)."""
        active = self._active_or_raise()
        arm = self._warming_arm(active)
        if arm is None:
            floor = self._floor(active)
            if floor > 0.0 and rng.random() < floor:
                arm = active[rng.randrange(len(active))]
            else:
                arm = self._exploit(rng, active)
        self.stats[arm].pulls += 1
        return arm

    def update(self, arm: str, reward: float) -> None:
        """Record a reward in [0, 1] for a request `arm` served (accepted while it is down too)."""
        self._check_arm(arm)
        if not (0.0 <= reward <= 1.0):
            raise ValueError(f"reward must be in [0, 1], got {reward}")
        stats = self.stats[arm]
        stats.rewards += 1
        stats.reward_sum += reward

    def revise(self, arm: str, old: float, new: float) -> None:
        """Replace a reward recorded by `update` (a client's late feedback changes it)."""
        self._check_arm(arm)
        if not (0.0 <= old <= 1.0 and 0.0 <= new <= 1.0):
            raise ValueError(f"rewards must be in [0, 1], got {old} -> {new}")
        if self.stats[arm].rewards == 0:
            raise ValueError(f"arm {arm!r} has no reward to revise")
        self.stats[arm].reward_sum += new - old

    def allocation(self) -> dict[str, float]:
        """The intended share of the next request per arm (0 for arms that are down)."""
        shares = dict.fromkeys(self.arms, 0.0)
        active = self.active_arms()
        if not active:
            return shares
        warming = [arm for arm in active if self.stats[arm].pulls < self.warmup]
        if warming:
            for arm in warming:
                shares[arm] = 1.0 / len(warming)
            return shares
        floor = self._floor(active)
        for arm, share in self._exploit_shares(active).items():
            shares[arm] = floor / len(active) + (1.0 - floor) * share
        return shares

    # -- for subclasses --------------------------------------------------------------------------

    def _exploit(self, rng: random.Random, active: list[str]) -> str:
        """The policy's own choice among the arms that are up."""
        raise NotImplementedError

    def _exploit_shares(self, active: list[str]) -> dict[str, float]:
        """The distribution `_exploit` draws from now, over `active`."""
        raise NotImplementedError

    def _floor(self, active: list[str]) -> float:
        """The probability of a uniform draw that guarantees the minimum share."""
        return min(1.0, self.min_share * len(active))

    # -- helpers ---------------------------------------------------------------------------------

    def _check_arm(self, arm: str) -> None:
        if arm not in self.stats:
            raise KeyError(f"unknown arm {arm!r}; arms are {self.arms}")

    def _active_or_raise(self) -> list[str]:
        active = self.active_arms()
        if not active:
            raise NoArmAvailable(f"every arm is down: {self.arms}")
        return active

    def _warming_arm(self, active: list[str]) -> str | None:
        """The least-pulled arm still under `warmup` pulls, or None once all have had theirs."""
        arm = min(active, key=lambda a: self.stats[a].pulls)
        return arm if self.stats[arm].pulls < self.warmup else None

    def _untried(self, active: list[str]) -> str | None:
        """The first arm that has no reward yet (tried before any exploitation), or None."""
        return next((arm for arm in active if self.stats[arm].rewards == 0), None)


def _argmax(active: list[str], score: Mapping[str, float]) -> str:
    """The arm with the highest score; ties go to the first in configured order."""
    return max(active, key=lambda arm: score[arm])


class FixedSplit(Policy):
    """A fixed traffic split by weights (renormalised over the arms that are up); learns nothing."""

    name = "fixed"

    def __init__(self, arms: Sequence[str], weights: Mapping[str, float], *,
                 min_share: float = 0.0, warmup: int = 0) -> None:
        super().__init__(arms, min_share=min_share, warmup=warmup)
        if set(weights) != set(self.arms):
            raise ValueError(f"weights must name exactly the arms {self.arms}, got {sorted(weights)}")
        total = sum(weights.values())
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"weights must sum to 1, got {total:g}")
        low = [arm for arm in self.arms if weights[arm] < min_share]
        if low:
            raise ValueError(f"weights of {low} are below min_share {min_share}")
        self.weights = {arm: float(weights[arm]) for arm in self.arms}

    def _floor(self, active: list[str]) -> float:
        return 0.0  # the weights already honour min_share

    def _exploit_shares(self, active: list[str]) -> dict[str, float]:
        total = sum(self.weights[arm] for arm in active)
        if total <= 0.0:
            return {arm: 1.0 / len(active) for arm in active}
        return {arm: self.weights[arm] / total for arm in active}

    def _exploit(self, rng: random.Random, active: list[str]) -> str:
        shares = self._exploit_shares(active)
        point = rng.random()
        for arm in active:
            point -= shares[arm]
            if point < 0.0:
                return arm
        return active[-1]


class EpsilonGreedy(Policy):
    """The best mean reward with probability 1 - epsilon, a uniform draw otherwise."""

    name = "epsilon_greedy"

    def __init__(self, arms: Sequence[str], *, epsilon: float = 0.1, min_share: float = 0.0,
                 warmup: int = 0) -> None:
        super().__init__(arms, min_share=min_share, warmup=warmup)
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        self.epsilon = epsilon

    def _greedy(self, active: list[str]) -> str:
        return self._untried(active) or _argmax(active, {a: self.stats[a].mean for a in active})

    def _exploit(self, rng: random.Random, active: list[str]) -> str:
        if rng.random() < self.epsilon:
            return active[rng.randrange(len(active))]
        return self._greedy(active)

    def _exploit_shares(self, active: list[str]) -> dict[str, float]:
        best = self._greedy(active)
        return {arm: self.epsilon / len(active) + (1.0 - self.epsilon) * (arm == best)
                for arm in active}


class UCB1(Policy):
    """Upper confidence bound: mean + exploration * sqrt(2 ln N / n), the highest bound wins."""

    name = "ucb1"

    def __init__(self, arms: Sequence[str], *, exploration: float = 1.0, min_share: float = 0.0,
                 warmup: int = 0) -> None:
        super().__init__(arms, min_share=min_share, warmup=warmup)
        if exploration < 0.0:
            raise ValueError(f"exploration must be >= 0, got {exploration}")
        self.exploration = exploration

    def bounds(self, active: list[str]) -> dict[str, float]:
        """The upper confidence bound of each arm that is up (inf before its first reward)."""
        total = sum(self.stats[arm].rewards for arm in active)
        log_total = math.log(max(total, 1))
        return {arm: (math.inf if self.stats[arm].rewards == 0 else
                      self.stats[arm].mean
                      + self.exploration * math.sqrt(2.0 * log_total / self.stats[arm].rewards))
                for arm in active}

    def _exploit(self, rng: random.Random, active: list[str]) -> str:
        return _argmax(active, self.bounds(active))

    def _exploit_shares(self, active: list[str]) -> dict[str, float]:
        best = self._exploit(random.Random(0), active)
        return {arm: float(arm == best) for arm in active}


class Thompson(Policy):
    """Thompson sampling with a Beta(prior_alpha + successes, prior_beta + failures) per arm.

    A reward r in [0, 1] adds r to the successes and 1 - r to the failures (the fractional
    Bernoulli update), so graded rewards work as well as 0/1 ones.
    """

    name = "thompson"
    ALLOCATION_SAMPLES = 2000  # Monte Carlo draws in `allocation` (its own seeded rng)

    def __init__(self, arms: Sequence[str], *, prior_alpha: float = 1.0, prior_beta: float = 1.0,
                 min_share: float = 0.0, warmup: int = 0) -> None:
        super().__init__(arms, min_share=min_share, warmup=warmup)
        if prior_alpha <= 0.0 or prior_beta <= 0.0:
            raise ValueError(f"prior_alpha and prior_beta must be > 0, got {prior_alpha}, {prior_beta}")
        self.prior_alpha = prior_alpha
        self.prior_beta = prior_beta

    def posterior(self, arm: str) -> tuple[float, float]:
        """The (alpha, beta) of `arm`'s Beta posterior."""
        stats = self.stats[arm]
        return (self.prior_alpha + stats.reward_sum,
                self.prior_beta + stats.rewards - stats.reward_sum)

    def _exploit(self, rng: random.Random, active: list[str]) -> str:
        draws = {arm: rng.betavariate(*self.posterior(arm)) for arm in active}
        return _argmax(active, draws)

    def _exploit_shares(self, active: list[str]) -> dict[str, float]:
        rng = random.Random(0)  # deterministic estimate of P(arm has the highest draw)
        wins = dict.fromkeys(active, 0)
        for _ in range(self.ALLOCATION_SAMPLES):
            wins[self._exploit(rng, active)] += 1
        return {arm: wins[arm] / self.ALLOCATION_SAMPLES for arm in active}


def make_policy(name: str, arms: Sequence[str], *, min_share: float = 0.0, warmup: int = 0,
                **params: object) -> Policy:
    """The policy called `name` (one of POLICY_NAMES) with its parameters."""
    classes: dict[str, type[Policy]] = {"fixed": FixedSplit, "epsilon_greedy": EpsilonGreedy,
                                        "ucb1": UCB1, "thompson": Thompson}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return classes[name](arms, min_share=min_share, warmup=warmup, **params)  # type: ignore[arg-type]
