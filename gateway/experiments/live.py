"""A running experiment in the gateway: picks the arm of each request and learns from how it went.

    pick(session key, request id, is_up)   health synced into the policy (an arm whose deployment has
                                           no healthy prefill or decode worker is marked down, its
                                           sessions move), then the sticky assignment
    finished(request id, Outcome)          the SLO/error reward -> policy.update
    feedback(request id, score)            the client's score joins the request's outcome; the
                                           reward is recomputed and replaces the first one
    abandoned(request id)                  cancelled by the client or refused as its fault: no reward

Recent requests are kept in a bounded table (`max_recent`, least recent forgotten first), so
feedback for a request older than that is refused as unknown. Everything runs on the gateway's
event loop: no locks.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.experiments import metrics
from gateway.experiments.assignment import StickyAssigner
from gateway.experiments.config import ExperimentConfig
from gateway.experiments.report import ArmRecord, ArmReport, percentile
from gateway.experiments.rewards import Outcome, reward

IsUp = Callable[[str], bool]  # arm (deployment name) -> whether it can serve now


@dataclass
class Pull:
    """One request routed to an arm, until it is forgotten."""

    arm: str
    outcome: Outcome | None = None  # set when the request ended
    reward: float | None = None  # what the policy was given for it
    feedback: float | None = None  # the client's score, once sent


class UnknownRequest(LookupError):
    """Feedback for a request id this experiment does not (or no longer) know."""


class LiveExperiment:
    """One experiment's policy, sticky assignment, recent requests and per-arm records."""

    def __init__(self, config: ExperimentConfig, *, seed: int | None = None, max_recent: int = 100_000,
                 max_sessions: int = 100_000) -> None:
        self.config = config
        self.name = config.model
        self.policy = config.build_policy()
        self.assigner = StickyAssigner(self.policy, random.Random(seed), max_sessions=max_sessions)
        self.max_recent = max_recent
        self.records = {arm: ArmRecord() for arm in config.arms}
        self._recent: OrderedDict[str, Pull] = OrderedDict()
        for arm in config.arms:
            metrics.ALLOCATION.labels(self.name, arm).set_function(lambda arm=arm: self.policy.allocation()[arm])

    # ---- routing -----------------------------------------------------------------------------

    def sync_health(self, is_up: IsUp) -> None:
        """Mark arms down (moving their sessions) or up as their deployments' health says."""
        active = set(self.policy.active_arms())
        for arm in self.config.arms:
            up = is_up(arm)
            metrics.ARM_UP.labels(self.name, arm).set(float(up))
            if up and arm not in active:
                self.assigner.mark_up(arm)
            elif not up and arm in active:
                self.assigner.mark_down(arm)

    def pick(self, session_key: str | None, request_id: str, is_up: IsUp) -> str:
        """The arm for this request (sticky per session key); NoArmAvailable when all are down."""
        self.sync_health(is_up)
        arm = self.assigner.assign(session_key or None)
        self.records[arm].requests += 1
        metrics.REQUESTS.labels(self.name, arm).inc()
        self._recent[request_id] = Pull(arm)
        self._recent.move_to_end(request_id)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)
        return arm

    # ---- learning ----------------------------------------------------------------------------

    def finished(self, request_id: str, outcome: Outcome) -> float | None:
        """The request ended (served or failed on its arm): record it and update the policy."""
        pull = self._recent.get(request_id)
        if pull is None or pull.outcome is not None:
            return None  # forgotten already, or recorded once
        pull.outcome = replace(outcome, feedback=pull.feedback)
        record = self.records[pull.arm]
        labels = (self.name, pull.arm)
        if outcome.error:
            record.errors += 1
            metrics.ERRORS.labels(*labels).inc()
        if outcome.ttft_s is not None:
            record.ttft_s.append(outcome.ttft_s)
            metrics.TTFT.labels(*labels).observe(outcome.ttft_s)
        if outcome.tpot_s is not None:
            record.tpot_s.append(outcome.tpot_s)
            metrics.TPOT.labels(*labels).observe(outcome.tpot_s)
        pull.reward = reward(pull.outcome, self.config.reward)
        self.policy.update(pull.arm, pull.reward)
        record.rewards.add(pull.reward)
        metrics.REWARD.labels(*labels).set(record.rewards.mean)
        return pull.reward

    def abandoned(self, request_id: str) -> None:
        """The request ended for a reason that is not its arm's doing: nothing to learn."""
        self._recent.pop(request_id, None)

    def knows(self, request_id: str) -> bool:
        return request_id in self._recent

    def feedback(self, request_id: str, score: float) -> tuple[str, float | None]:
        """Join a client's score to its request: (arm, the request's reward now; None while it runs).

        UnknownRequest when the id is not known; ValueError when the score is out of range."""
        pull = self._recent.get(request_id)
        if pull is None:
            raise UnknownRequest(request_id)
        cfg = self.config.reward
        if not cfg.feedback_min <= score <= cfg.feedback_max:
            raise ValueError(f"score {score:g} is outside this experiment's feedback range "
                             f"[{cfg.feedback_min:g}, {cfg.feedback_max:g}]")
        if pull.feedback is None:
            self.records[pull.arm].feedback += 1
            metrics.FEEDBACK.labels(self.name, pull.arm).inc()
        pull.feedback = score
        if pull.outcome is None:
            return pull.arm, None  # still running: `finished` includes it
        pull.outcome = replace(pull.outcome, feedback=score)
        new = reward(pull.outcome, cfg)
        assert pull.reward is not None
        self.policy.revise(pull.arm, pull.reward, new)
        record = self.records[pull.arm]
        record.rewards.replace(pull.reward, new)
        pull.reward = new
        metrics.REWARD.labels(self.name, pull.arm).set(record.rewards.mean)
        return pull.arm, new

    # ---- report ------------------------------------------------------------------------------

    def report(self, is_up: IsUp) -> list[ArmReport]:
        """One row per arm, in configured order (health synced first)."""
        self.sync_health(is_up)
        allocation = self.policy.allocation()
        total = sum(r.requests for r in self.records.values())
        active = set(self.policy.active_arms())
        rows = []
        for arm, r in self.records.items():
            rows.append(ArmReport(
                experiment=self.name, arm=arm, policy=self.policy.name, requests=r.requests,
                share=r.requests / total if total else 0.0, rewarded=r.rewards.n, reward_mean=r.rewards.mean,
                reward_ci95=r.rewards.ci95, ttft_p50_s=percentile(r.ttft_s, 50), ttft_p99_s=percentile(r.ttft_s, 99),
                tpot_p50_s=percentile(r.tpot_s, 50), tpot_p99_s=percentile(r.tpot_s, 99), errors=r.errors,
                feedback=r.feedback, allocation=allocation[arm], up=arm in active))
        return rows
