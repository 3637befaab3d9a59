"""The reward of one request, in [0, 1], from what the gateway and the client observed.

Components, each in [0, 1]:
  * ttft: 1 when time to first token <= `ttft_slo_s`, else 0;
  * tpot: 1 when time per output token <= `tpot_slo_s`, else 0 (left out when the request produced
    a single token and has no TPOT);
  * success: 0 when the request failed, else 1 (a failed request also scores 0 on ttft and tpot);
  * feedback: the client's score mapped from [feedback_min, feedback_max] to [0, 1] (left out when
    the client gave none).
The reward is the weighted mean of the components present: sum(w * x) / sum(w) over them. A weight
of 0 drops a component.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """What is known about one request when its reward is computed."""

    error: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    feedback: float | None = None


@dataclass(frozen=True)
class RewardConfig:
    """SLO thresholds and component weights; validated on construction."""

    ttft_slo_s: float = 0.5
    tpot_slo_s: float = 0.05
    w_ttft: float = 1.0
    w_tpot: float = 1.0
    w_success: float = 1.0
    w_feedback: float = 0.0
    feedback_min: float = 0.0
    feedback_max: float = 1.0

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if not getattr(self, name) > 0.0:
                raise ValueError(f"reward.{name} must be > 0, got {getattr(self, name)}")
        weights = ("w_ttft", "w_tpot", "w_success", "w_feedback")
        for name in weights:
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"reward.{name} must be >= 0, got {getattr(self, name)}")
        if sum(getattr(self, name) for name in weights) <= 0.0:
            raise ValueError(f"reward weights {', '.join(weights)} are all 0; at least one must be > 0")
        if not self.feedback_max > self.feedback_min:
            raise ValueError(f"reward.feedback_max ({self.feedback_max}) must be greater than "
                             f"reward.feedback_min ({self.feedback_min})")


def components(outcome: Outcome, config: RewardConfig) -> dict[str, float]:
    """The components present for `outcome`, each in [0, 1] (see the module docstring)."""
    parts: dict[str, float] = {"success": 0.0 if outcome.error else 1.0}
    if outcome.error:
        parts["ttft"] = 0.0
        parts["tpot"] = 0.0
    else:
        if outcome.ttft_s is not None:
            parts["ttft"] = float(outcome.ttft_s <= config.ttft_slo_s)
        if outcome.tpot_s is not None:
            parts["tpot"] = float(outcome.tpot_s <= config.tpot_slo_s)
    if outcome.feedback is not None:
        if not config.feedback_min <= outcome.feedback <= config.feedback_max:
            raise ValueError(f"feedback {outcome.feedback} is outside "
                             f"[{config.feedback_min}, {config.feedback_max}]")
        span = config.feedback_max - config.feedback_min
        parts["feedback"] = (outcome.feedback - config.feedback_min) / span
    return parts


def reward(outcome: Outcome, config: RewardConfig) -> float:
    """The weighted mean of the components present, in [0, 1]."""
    weight = {"ttft": config.w_ttft, "tpot": config.w_tpot, "success": config.w_success,
              "feedback": config.w_feedback}
    parts = components(outcome, config)
    total = sum(weight[name] for name in parts)
    if total <= 0.0:  # only zero-weighted components present (e.g. feedback-only weights, none given)
        return 0.0 if outcome.error else 1.0
    return sum(weight[name] * value for name, value in parts.items()) / total
