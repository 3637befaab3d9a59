"""gateway.experiments: bandit policies against a simulated environment with known reward rates,
sticky assignment, rewards and config validation. Pure Python, no workers; runs in well under 10 s.

The environment: three arms whose rewards are Bernoulli with rates 0.3 / 0.5 / 0.7, so arm "c" is
the known best. Thresholds were measured over seeds 0..19 (worst seed in brackets) and set below
the worst with margin; the tests run seeds 0..4.
"""

from __future__ import annotations

import random

import pytest

from gateway.experiments.assignment import StickyAssigner
from gateway.experiments.config import ExperimentConfigError, loads
from gateway.experiments.policies import NoArmAvailable, Policy, make_policy
from gateway.experiments.rewards import Outcome, RewardConfig, reward

RATES = {"a": 0.3, "b": 0.5, "c": 0.7}
BEST = "c"
SEEDS = range(5)
LAST_K = 500


def simulate(policy: Policy, seed: int, requests: int) -> list[str]:
    """Run `requests` through `policy` with Bernoulli(RATES[arm]) rewards; the arms chosen."""
    rng, env = random.Random(seed), random.Random(seed + 1000)
    chosen = []
    for _ in range(requests):
        arm = policy.choose(rng)
        policy.update(arm, float(env.random() < RATES[arm]))
        chosen.append(arm)
    return chosen


def share(chosen: list[str], arm: str) -> float:
    return chosen.count(arm) / len(chosen)


# name, params, requests, threshold on the best arm's share of the last LAST_K requests
CONVERGENCE = [
    ("epsilon_greedy", {"epsilon": 0.1}, 1000, 0.85),  # measured >= 0.90 (mean 0.93)
    ("ucb1", {}, 2000, 0.75),  # measured >= 0.81 (mean 0.93)
    ("thompson", {}, 1000, 0.85),  # measured >= 0.92 (mean 0.99)
]


@pytest.mark.parametrize("name,params,requests,threshold", CONVERGENCE, ids=[c[0] for c in CONVERGENCE])
@pytest.mark.parametrize("seed", SEEDS)
def test_bandit_puts_most_traffic_on_the_best_arm(name, params, requests, threshold, seed):
    policy = make_policy(name, list(RATES), warmup=10, **params)
    chosen = simulate(policy, seed, requests)
    assert share(chosen[-LAST_K:], BEST) > threshold
    assert max(policy.allocation(), key=policy.allocation().get) == BEST
    # the learned means approach the known rates on the arm that was pulled the most
    assert policy.stats[BEST].mean == pytest.approx(RATES[BEST], abs=0.06)


def test_simulation_is_deterministic_given_the_seed():
    runs = [simulate(make_policy("thompson", list(RATES), warmup=5), 7, 300) for _ in range(2)]
    assert runs[0] == runs[1]


def test_fixed_split_matches_its_weights():
    weights = {"a": 0.2, "b": 0.3, "c": 0.5}
    policy = make_policy("fixed", list(RATES), weights=weights)
    chosen = simulate(policy, 0, 20_000)
    for arm, weight in weights.items():
        assert share(chosen, arm) == pytest.approx(weight, abs=0.015)
    assert policy.allocation() == pytest.approx(weights)


@pytest.mark.parametrize("name", ["epsilon_greedy", "ucb1", "thompson"])
def test_minimum_share_is_respected(name):
    policy = make_policy(name, list(RATES), min_share=0.1)
    chosen = simulate(policy, 3, 4000)
    for arm in RATES:  # 0.1 expected per arm, the worst arm included; 4000 draws: sd ~0.005
        assert share(chosen[-2000:], arm) >= 0.085
        assert policy.allocation()[arm] >= 0.1 - 1e-9


@pytest.mark.parametrize("name", ["epsilon_greedy", "ucb1", "thompson", "fixed"])
def test_warmup_gives_every_arm_its_pulls_before_exploiting(name):
    params = {"weights": {"a": 0.98, "b": 0.01, "c": 0.01}} if name == "fixed" else {}
    policy = make_policy(name, list(RATES), warmup=20, **params)
    chosen = simulate(policy, 1, 60)
    assert {arm: chosen.count(arm) for arm in RATES} == {"a": 20, "b": 20, "c": 20}


def test_reward_outside_unit_interval_and_unknown_arm_are_rejected():
    policy = make_policy("ucb1", ["a", "b"])
    with pytest.raises(ValueError, match="reward"):
        policy.update("a", 1.5)
    with pytest.raises(KeyError, match="unknown arm"):
        policy.update("z", 0.5)


def test_sessions_keep_their_arm():
    assigner = StickyAssigner(make_policy("thompson", list(RATES)), random.Random(0))
    first = {f"s{i}": assigner.assign(f"s{i}") for i in range(100)}
    assert len(set(first.values())) == 3  # new sessions were spread over the arms
    pulls = sum(s.pulls for s in assigner.policy.stats.values())
    for _ in range(3):
        assert {sid: assigner.assign(sid) for sid in first} == first
    assert sum(s.pulls for s in assigner.policy.stats.values()) == pulls  # no new pulls


def test_arm_down_moves_its_sessions_and_is_not_chosen_until_back():
    assigner = StickyAssigner(make_policy("epsilon_greedy", list(RATES), epsilon=1.0), random.Random(0))
    before = {f"s{i}": assigner.assign(f"s{i}") for i in range(60)}
    on_b = [sid for sid, arm in before.items() if arm == "b"]
    moved = assigner.mark_down("b")
    assert sorted(moved) == sorted(on_b) and on_b
    assert set(moved.values()) <= {"a", "c"}
    assert all(assigner.assign(sid) == before[sid] for sid in before if sid not in on_b)
    assert "b" not in {assigner.assign(f"new{i}") for i in range(100)}
    assert assigner.policy.allocation()["b"] == 0.0
    assigner.mark_up("b")
    assert all(assigner.assign(sid) == moved[sid] for sid in on_b)  # moved sessions stay
    assert "b" in {assigner.assign(f"back{i}") for i in range(100)}


def test_all_arms_down_raises_and_forgets_sessions():
    assigner = StickyAssigner(make_policy("ucb1", ["a", "b"]), random.Random(0))
    assigner.assign("s")
    assigner.mark_down("a")
    assigner.mark_down("b")
    assert assigner.arm_of("s") is None
    with pytest.raises(NoArmAvailable):
        assigner.assign("s")


def test_sticky_table_is_bounded():
    assigner = StickyAssigner(make_policy("ucb1", ["a", "b"]), random.Random(0), max_sessions=10)
    for i in range(25):
        assigner.assign(f"s{i}")
    assert len(assigner) == 10 and assigner.arm_of("s0") is None and assigner.arm_of("s24")


# -- rewards --------------------------------------------------------------------------------------

CFG = RewardConfig(ttft_slo_s=0.5, tpot_slo_s=0.05, w_ttft=1, w_tpot=1, w_success=2, w_feedback=4,
                   feedback_min=1, feedback_max=5)


@pytest.mark.parametrize("outcome,expected", [
    (Outcome(ttft_s=0.2, tpot_s=0.01), 1.0),
    (Outcome(ttft_s=0.9, tpot_s=0.01), 3 / 4),  # ttft missed: (0 + 1 + 2) / 4
    (Outcome(ttft_s=0.2, tpot_s=None), 1.0),  # single token: tpot left out
    (Outcome(error=True), 0.0),
    (Outcome(ttft_s=0.2, tpot_s=0.01, feedback=1), 4 / 8),  # worst feedback: (1+1+2+0) / 8
    (Outcome(ttft_s=0.9, tpot_s=0.2, feedback=4), (2 + 4 * 0.75) / 8),
    (Outcome(error=True, feedback=5), 4 / 8),
])
def test_reward_combines_slo_error_and_feedback(outcome, expected):
    assert reward(outcome, CFG) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs,message", [
    ({"ttft_slo_s": 0}, "ttft_slo_s must be > 0"),
    ({"w_tpot": -1}, "w_tpot must be >= 0"),
    ({"w_ttft": 0, "w_tpot": 0, "w_success": 0, "w_feedback": 0}, "all 0"),
    ({"feedback_min": 5, "feedback_max": 1}, "feedback_max"),
])
def test_reward_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**kwargs)


def test_feedback_outside_its_range_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        reward(Outcome(ttft_s=0.1, feedback=6), CFG)


# -- config -----------------------------------------------------------------------------------------

GOOD = """
[experiments.chat]
arms = ["dep-a", "dep-b", "dep-c"]
policy = "thompson"
min_share = 0.05
warmup = 20
[experiments.chat.params]
prior_alpha = 2
[experiments.chat.reward]
ttft_ms = 400
w_feedback = 1

[experiments.code]
arms = ["dep-a", "dep-b"]
policy = "fixed"
[experiments.code.params]
weights = { dep-a = 0.9, dep-b = 0.1 }
"""


def test_config_loads_and_builds_policies():
    configs = loads(GOOD, known_deployments={"dep-a", "dep-b", "dep-c"})
    chat, code = configs["chat"], configs["code"]
    assert chat.arms == ("dep-a", "dep-b", "dep-c") and chat.warmup == 20
    assert chat.reward.ttft_slo_s == pytest.approx(0.4) and chat.reward.w_feedback == 1
    policy = chat.build_policy()
    assert policy.name == "thompson" and policy.prior_alpha == 2 and policy.min_share == 0.05
    assert code.build_policy().allocation() == pytest.approx({"dep-a": 0.9, "dep-b": 0.1})


def _experiment(body: str) -> str:
    return "[experiments.m]\n" + body


@pytest.mark.parametrize("text,message", [
    (_experiment('arms = ["a", "b"]\npolicy = "softmax"'),
     "experiments.m.policy: unknown policy 'softmax'"),
    (_experiment('arms = ["a", "b"]\npolicy = "fixed"\n[experiments.m.params]\nweights = {a = 0.5, b = 0.4}'),
     "experiments.m.params.weights: shares sum to 0.9, not 1"),
    (_experiment('arms = ["a", "b", "c"]\npolicy = "ucb1"\nmin_share = 0.4'),
     r"experiments.m.min_share: 0.4 is too large for 3 arms \(at most 0.333333\)"),
    (_experiment('arms = ["a", "zz"]\npolicy = "ucb1"'),
     "experiments.m.arms: unknown arm 'zz'"),
    (_experiment('arms = ["a", "b"]\npolicy = "fixed"\n[experiments.m.params]\nweights = {a = 0.5, c = 0.5}'),
     "experiments.m.params.weights.c: unknown arm"),
    (_experiment('arms = ["a", "b"]\npolicy = "fixed"\nmin_share = 0.2\n[experiments.m.params]\n'
                 'weights = {a = 0.9, b = 0.1}'),
     "experiments.m.params.weights.b: 0.1 is below min_share 0.2"),
    (_experiment('arms = ["a", "b"]\npolicy = "fixed"'), "experiments.m.params.weights: required"),
    (_experiment('arms = ["a"]\npolicy = "ucb1"'), "experiments.m.arms: an experiment needs at least 2"),
    (_experiment('arms = ["a", "a"]\npolicy = "ucb1"'), "experiments.m.arms: duplicate arm 'a'"),
    (_experiment('policy = "ucb1"'), "experiments.m.arms: required"),
    (_experiment('arms = ["a", "b"]\npolicy = "ucb1"\n[experiments.m.params]\nepsilon = 0.1'),
     "experiments.m.params.epsilon: unknown field"),
    (_experiment('arms = ["a", "b"]\npolicy = "epsilon_greedy"\n[experiments.m.params]\nepsilon = 2'),
     r"experiments.m.params.epsilon: must be in \[0, 1\]"),
    (_experiment('arms = ["a", "b"]\npolicy = "ucb1"\nwarmup = -1'), "experiments.m.warmup: must be an integer"),
    (_experiment('arms = ["a", "b"]\npolicy = "ucb1"\ncolour = "red"'), "experiments.m.colour: unknown field"),
    (_experiment('arms = ["a", "b"]\npolicy = "ucb1"\n[experiments.m.reward]\nttft_ms = 0'),
     "experiments.m.reward: reward.ttft_slo_s must be > 0"),
    (_experiment('arms = ["a", "b"]\npolicy = "ucb1"\n[experiments.m.reward]\nw_foo = 1'),
     "experiments.m.reward.w_foo: unknown field"),
    ("[experiments.m\n", r"\(toml\)"),
])
def test_config_validation_errors_name_the_field(text, message):
    with pytest.raises(ExperimentConfigError, match=message) as info:
        loads(text, known_deployments={"a", "b", "c"})
    assert "\n" not in str(info.value)


# -- the whole config file: deployments and experiments ---------------------------------------------

SERVE = """
default_model = "chat"
[deployments.fp32]
model = "{model}"
prefill = 2
prefill_targets = ["127.0.0.1:1"]
decode_targets = ["127.0.0.1:2", "127.0.0.1:3"]
[deployments.int8]
model = "{model}"
kv_dtype = "float16"
block_size = 32
[experiments.chat]
arms = ["fp32", "int8"]
policy = "ucb1"
"""


def _serve_file(tmp_path, text: str):
    from conftest import STORIES_GGUF

    path = tmp_path / "serve.toml"
    path.write_text(text.format(model=STORIES_GGUF))
    return path


def test_serve_config_loads_deployments_and_fills_in_targets(tmp_path):
    from gateway.experiments.serve_config import load_serve_config

    config = load_serve_config(_serve_file(tmp_path, SERVE))
    fp32, int8 = config.deployments["fp32"], config.deployments["int8"]
    assert (fp32.prefill, fp32.decode, fp32.kv_dtype, int8.kv_dtype, int8.block_size) == (2, None, "float32",
                                                                                          "float16", 32)
    assert config.public_names() == ["chat", "fp32", "int8"] and config.default_model == "chat"
    with pytest.raises(ExperimentConfigError, match=r"deployments.int8.prefill_targets: required by `pdserve "
                                                    r"gateway --config`.*--deployment-targets int8:prefill=ADDR"):
        config.require_targets()
    filled = config.with_targets(["int8:prefill=127.0.0.1:4", "int8:decode=127.0.0.1:5,127.0.0.1:6",
                                  "int8:kvstore=127.0.0.1:7"])
    filled.require_targets()
    assert filled.deployments["int8"].decode_targets == ("127.0.0.1:5", "127.0.0.1:6")
    assert filled.deployments["int8"].kvstore_target == "127.0.0.1:7"
    assert filled.deployments["fp32"] == fp32


@pytest.mark.parametrize("text,message", [
    ("", "deployments: at least one"),
    ("[deployments.a]\n", r"deployments.a.model: required"),
    ('[deployments.a]\nmodel = "/nonexistent/x.gguf"', "deployments.a.model: no such file or directory"),
    ('[deployments.a]\nmodel = "{model}"\nkv_dtype = "int3"', "deployments.a.kv_dtype: unknown dtype 'int3'"),
    ('[deployments.a]\nmodel = "{model}"\ndecode = 0', r"deployments.a.decode: must be an integer >= 1"),
    ('[deployments.a]\nmodel = "{model}"\ngpus = 2', "deployments.a.gpus: unknown field"),
    ('[deployments."a b"]\nmodel = "{model}"', "deployments.a b: the name 'a b' must be"),
    ('[deployments.a]\nmodel = "{model}"\nprefill_targets = "x:1"', "deployments.a.prefill_targets: must be a list"),
    ('[deployments.a]\nmodel = "{model}"\n[deployments.b]\nmodel = "{model}"\n[experiments.a]\narms = ["a", "b"]\n'
     'policy = "ucb1"', "experiments.a: the name is also a deployment's"),
    ('[deployments.a]\nmodel = "{model}"\n[experiments.m]\narms = ["a", "c"]\npolicy = "ucb1"',
     "experiments.m.arms: unknown arm 'c'; deployments are a"),
    ('default_model = "x"\n[deployments.a]\nmodel = "{model}"', "default_model: unknown model 'x'; the file serves a"),
    ('deployment = 1', r"\(top level\).deployment: unknown field"),
    ('[deployments.a\n', "not valid TOML"),
])
def test_serve_config_errors_name_the_field(tmp_path, text, message):
    from gateway.experiments.serve_config import load_serve_config

    with pytest.raises(ExperimentConfigError, match=message) as info:
        load_serve_config(_serve_file(tmp_path, text))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flag,message", [
    ("fp32:prefill", "expected NAME:KIND=ADDR"),
    ("gpu:prefill=x:1", "unknown deployment 'gpu'; deployments are fp32, int8"),
    ("fp32:router=x:1", "unknown kind 'router'"),
    ("fp32:kvstore=x:1,y:2", "a deployment has one kvstore, got 2"),
])
def test_deployment_target_flags_are_checked(tmp_path, flag, message):
    from gateway.experiments.serve_config import load_serve_config

    with pytest.raises(ExperimentConfigError, match=message):
        load_serve_config(_serve_file(tmp_path, SERVE)).with_targets([flag])


# -- the live experiment: routing, rewards, feedback, report ------------------------------------------

def _live(policy: str = "ucb1", **params):
    from gateway.experiments.config import ExperimentConfig
    from gateway.experiments.live import LiveExperiment

    config = ExperimentConfig("m", ("a", "b"), policy, params=params,
                              reward=RewardConfig(ttft_slo_s=0.1, tpot_slo_s=0.01, w_feedback=1.0))
    return LiveExperiment(config, seed=0)


def _up(*arms):
    return lambda arm: arm in arms


def test_live_experiment_rewards_and_late_feedback_replace_the_reward():
    from gateway.experiments.live import UnknownRequest

    exp = _live()
    arm = exp.pick("s1", "r1", _up("a", "b"))
    assert exp.pick("s1", "r2", _up("a", "b")) == arm  # sticky
    assert exp.finished("r1", Outcome(ttft_s=0.05, tpot_s=0.02)) == pytest.approx(2 / 3)  # tpot missed
    assert exp.finished("r1", Outcome(error=True)) is None  # recorded once
    assert exp.feedback("r1", 1.0) == (arm, pytest.approx(3 / 4))
    assert exp.policy.stats[arm].reward_sum == pytest.approx(3 / 4) and exp.policy.stats[arm].rewards == 1
    assert exp.feedback("r1", 0.0) == (arm, pytest.approx(2 / 4))  # a second score replaces the first
    assert exp.feedback("r2", 0.0) == (arm, None)  # still running: joins when it ends
    assert exp.finished("r2", Outcome(ttft_s=0.05, tpot_s=0.001)) == pytest.approx(3 / 4)
    rows = {r.arm: r for r in exp.report(_up("a", "b"))}
    assert (rows[arm].requests, rows[arm].rewarded, rows[arm].feedback, rows[arm].share) == (2, 2, 2, 1.0)
    assert rows[arm].reward_mean == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert rows[arm].ttft_p50_s == pytest.approx(0.05) and rows[arm].tpot_p99_s == pytest.approx(0.02)
    with pytest.raises(UnknownRequest):
        exp.feedback("nope", 1.0)
    with pytest.raises(ValueError, match=r"outside this experiment's feedback range \[0, 1\]"):
        exp.feedback("r1", 2.0)
    exp.pick(None, "r3", _up("a", "b"))
    exp.abandoned("r3")  # cancelled: nothing learnt, and feedback for it is refused
    with pytest.raises(UnknownRequest):
        exp.feedback("r3", 1.0)


def test_live_experiment_follows_deployment_health():
    exp = _live("fixed", weights={"a": 0.5, "b": 0.5})
    sessions = {f"s{i}": exp.pick(f"s{i}", f"r{i}", _up("a", "b")) for i in range(20)}
    assert set(sessions.values()) == {"a", "b"}
    assert exp.pick("s-new", "r-new", _up("a")) == "a"  # b's deployment went down
    assert all(exp.assigner.arm_of(s) == "a" for s in sessions)  # b's sessions moved at once
    rows = {r.arm: r for r in exp.report(_up("a"))}
    assert (rows["b"].up, rows["b"].allocation, rows["a"].allocation) == (False, 0.0, 1.0)
    assert exp.report(_up("a", "b"))[1].up  # back up: chosen again for new sessions


def test_reward_confidence_interval_and_percentiles():
    import statistics

    from gateway.experiments.report import Z_95, RewardMoments, percentile

    values = [0.0, 1.0, 1.0, 0.5, 0.25, 1.0]
    m = RewardMoments()
    for v in values:
        m.add(v)
    m.replace(0.5, 0.75)
    values[3] = 0.75
    assert m.mean == pytest.approx(statistics.fmean(values))
    assert m.ci95 == pytest.approx(Z_95 * statistics.stdev(values) / len(values) ** 0.5)
    assert RewardMoments().ci95 == 0.0 and percentile([], 50) == 0.0
    assert percentile(list(range(1, 101)), 50) == 50 and percentile(list(range(1, 101)), 99) == 99
