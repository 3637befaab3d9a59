"""Experiment configuration from TOML: per public model name, its arms, policy and reward.

    [experiments."llama-chat"]              # the model name clients ask for
    arms = ["llama-8b-a", "llama-8b-b"]     # deployment names, one per arm
    policy = "thompson"                     # fixed | epsilon_greedy | ucb1 | thompson
    min_share = 0.05                        # every arm gets at least this share (default 0)
    warmup = 20                             # pulls per arm before exploiting (default 0)

    [experiments."llama-chat".params]       # the policy's own parameters
    prior_alpha = 1.0                       # thompson: prior_alpha, prior_beta
                                            # epsilon_greedy: epsilon; ucb1: exploration
                                            # fixed: weights = { "llama-8b-a" = 0.9, ... }

    [experiments."llama-chat".reward]       # RewardConfig fields; ttft_ms / tpot_ms for the SLOs
    ttft_ms = 500
    tpot_ms = 50
    w_feedback = 1.0

Every error is an `ExperimentConfigError` whose one-line message starts with the field's path.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.experiments.policies import POLICY_NAMES, Policy, make_policy
from gateway.experiments.rewards import RewardConfig

POLICY_PARAMS: dict[str, dict[str, type]] = {
    "fixed": {"weights": dict},
    "epsilon_greedy": {"epsilon": float},
    "ucb1": {"exploration": float},
    "thompson": {"prior_alpha": float, "prior_beta": float},
}
EXPERIMENT_KEYS = {"arms", "policy", "min_share", "warmup", "params", "reward"}
REWARD_KEYS = {"ttft_ms", "tpot_ms", "w_ttft", "w_tpot", "w_success", "w_feedback",
               "feedback_min", "feedback_max"}


class ExperimentConfigError(ValueError):
    """An invalid experiment configuration; the message names the field."""


@dataclass(frozen=True)
class ExperimentConfig:
    """One experiment: the public model name, its arms, and how traffic is allocated and scored."""

    model: str
    arms: tuple[str, ...]
    policy: str
    min_share: float = 0.0
    warmup: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def build_policy(self) -> Policy:
        """A fresh policy for this experiment."""
        return make_policy(self.policy, self.arms, min_share=self.min_share, warmup=self.warmup,
                           **self.params)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ExperimentConfigError(f"{where}: must be a number, got {value!r}")
    return float(value)


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ExperimentConfigError(f"{where}: must be a table, got {value!r}")
    return value


def _unknown_keys(table: Mapping[str, Any], allowed: Collection[str], where: str) -> None:
    extra = sorted(set(table) - set(allowed))
    if extra:
        raise ExperimentConfigError(f"{where}.{extra[0]}: unknown field; "
                                    f"expected one of {', '.join(sorted(allowed))}")


def _parse_arms(value: Any, where: str, known: Collection[str] | None) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
        raise ExperimentConfigError(f"{where}: must be a list of deployment names, got {value!r}")
    if len(value) < 2:
        raise ExperimentConfigError(f"{where}: an experiment needs at least 2 arms, got {len(value)}")
    duplicates = sorted({a for a in value if value.count(a) > 1})
    if duplicates:
        raise ExperimentConfigError(f"{where}: duplicate arm {duplicates[0]!r}")
    if known is not None:
        unknown = [a for a in value if a not in known]
        if unknown:
            raise ExperimentConfigError(f"{where}: unknown arm {unknown[0]!r}; deployments are "
                                        f"{', '.join(sorted(known)) or '(none)'}")
    return tuple(value)


def _parse_weights(value: Any, arms: tuple[str, ...], min_share: float, where: str) -> dict[str, float]:
    weights = _table(value, where)
    for arm in weights:
        if arm not in arms:
            raise ExperimentConfigError(f"{where}.{arm}: unknown arm; arms are {', '.join(arms)}")
    missing = [arm for arm in arms if arm not in weights]
    if missing:
        raise ExperimentConfigError(f"{where}: no weight for arm {missing[0]!r}")
    shares = {arm: _number(weights[arm], f"{where}.{arm}") for arm in arms}
    for arm, share in shares.items():
        if share < 0.0:
            raise ExperimentConfigError(f"{where}.{arm}: must be >= 0, got {share:g}")
        if share < min_share:
            raise ExperimentConfigError(f"{where}.{arm}: {share:g} is below min_share {min_share:g}")
    total = sum(shares.values())
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ExperimentConfigError(f"{where}: shares sum to {total:g}, not 1")
    return shares


def _parse_params(value: Any, policy: str, arms: tuple[str, ...], min_share: float,
                  where: str) -> dict[str, Any]:
    table = _table(value, where)
    _unknown_keys(table, POLICY_PARAMS[policy], where)
    params: dict[str, Any] = {}
    for key, raw in table.items():
        if key == "weights":
            params[key] = _parse_weights(raw, arms, min_share, f"{where}.weights")
            continue
        number = _number(raw, f"{where}.{key}")
        if key == "epsilon" and not 0.0 <= number <= 1.0:
            raise ExperimentConfigError(f"{where}.epsilon: must be in [0, 1], got {number:g}")
        if key == "exploration" and number < 0.0:
            raise ExperimentConfigError(f"{where}.exploration: must be >= 0, got {number:g}")
        if key in ("prior_alpha", "prior_beta") and number <= 0.0:
            raise ExperimentConfigError(f"{where}.{key}: must be > 0, got {number:g}")
        params[key] = number
    if policy == "fixed" and "weights" not in params:
        raise ExperimentConfigError(f"{where}.weights: required for policy 'fixed'")
    return params


def _parse_reward(value: Any, where: str) -> RewardConfig:
    table = _table(value, where)
    _unknown_keys(table, REWARD_KEYS, where)
    fields = {key: _number(raw, f"{where}.{key}") for key, raw in table.items()}
    if "ttft_ms" in fields:
        fields["ttft_slo_s"] = fields.pop("ttft_ms") / 1000.0
    if "tpot_ms" in fields:
        fields["tpot_slo_s"] = fields.pop("tpot_ms") / 1000.0
    try:
        return RewardConfig(**fields)
    except ValueError as exc:
        raise ExperimentConfigError(f"{where}: {exc}") from None


def parse_experiment(model: str, table: Any, known_deployments: Collection[str] | None = None,
                     ) -> ExperimentConfig:
    """One `[experiments.<model>]` table, validated."""
    where = f"experiments.{model}"
    table = _table(table, where)
    _unknown_keys(table, EXPERIMENT_KEYS, where)
    for key in ("arms", "policy"):
        if key not in table:
            raise ExperimentConfigError(f"{where}.{key}: required")
    arms = _parse_arms(table["arms"], f"{where}.arms", known_deployments)
    policy = table["policy"]
    if policy not in POLICY_NAMES:
        raise ExperimentConfigError(f"{where}.policy: unknown policy {policy!r}; "
                                    f"choose one of {', '.join(POLICY_NAMES)}")
    min_share = _number(table.get("min_share", 0.0), f"{where}.min_share")
    if min_share < 0.0:
        raise ExperimentConfigError(f"{where}.min_share: must be >= 0, got {min_share:g}")
    if min_share * len(arms) > 1.0 + 1e-9:
        raise ExperimentConfigError(f"{where}.min_share: {min_share:g} is too large for "
                                    f"{len(arms)} arms (at most {1.0 / len(arms):g})")
    warmup = table.get("warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ExperimentConfigError(f"{where}.warmup: must be an integer >= 0, got {warmup!r}")
    params = _parse_params(table.get("params", {}), policy, arms, min_share, f"{where}.params")
    reward = _parse_reward(table.get("reward", {}), f"{where}.reward")
    return ExperimentConfig(model=model, arms=arms, policy=policy, min_share=min_share,
                            warmup=warmup, params=params, reward=reward)


def parse_config(data: Mapping[str, Any], known_deployments: Collection[str] | None = None,
                 ) -> dict[str, ExperimentConfig]:
    """Every experiment of a parsed TOML document, by public model name."""
    _unknown_keys(data, {"experiments"}, "(top level)")
    experiments = _table(data.get("experiments", {}), "experiments")
    return {model: parse_experiment(model, table, known_deployments)
            for model, table in experiments.items()}


def loads(text: str, known_deployments: Collection[str] | None = None) -> dict[str, ExperimentConfig]:
    """Parse and validate TOML text."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentConfigError(f"(toml): {exc}") from None
    return parse_config(data, known_deployments)


def load(path: str | Path, known_deployments: Collection[str] | None = None,
         ) -> dict[str, ExperimentConfig]:
    """Parse and validate the TOML file at `path`."""
    return loads(Path(path).read_text(encoding="utf-8"), known_deployments)
