"""gateway.disagg: the placement policies' choices on a table of cluster states, the learned
constants, the counter and the flags (pure: no processes; the stack test is in test_stack_disagg)."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import REGISTRY

from gateway import disagg
from gateway.disagg import AlwaysLocal, ConditionalPlacement, DisaggConfig, make_placement
from gateway.placement import AlwaysRemote, PlacementInputs

# 1 ms of prefill per token, 20 ms per remote hop, 64-token local threshold, busy at 24 of 32.
CONFIG = DisaggConfig(local_max_tokens=64, busy_fraction=0.75, decode_batch=32, prefill_s_per_token=1e-3,
                      remote_overhead_s=0.02, local_penalty=1.0)


def inputs(prompt: int, cached: int = 0, prefill_inflight: int = 0, prefill_healthy: int = 1,
           decode_running: int = 0, decode_inflight: int = 0) -> PlacementInputs:
    return PlacementInputs(prompt, cached, prefill_inflight, prefill_healthy, decode_running, decode_inflight)


def warmed(long_prompt: int = 800, n: int = 30) -> ConditionalPlacement:
    """A policy that has sent `n` long prompts remote (its mean remote prompt is about `long_prompt`)."""
    policy = ConditionalPlacement(CONFIG)
    for _ in range(n):
        assert policy.place(inputs(long_prompt)) == "remote"
    return policy


@pytest.mark.parametrize("case, state, expected", [
    ("short prompt", inputs(20), "local"),
    ("at the threshold", inputs(64), "local"),
    ("just over it, idle cluster", inputs(65), "remote"),
    ("long prompt", inputs(800), "remote"),
    ("cached prefix leaves 32 tokens", inputs(800, cached=768), "local"),
    ("cached prefix leaves 96 tokens", inputs(800, cached=704), "remote"),
    ("long prefill queue", inputs(800, prefill_inflight=8), "local"),
    ("half that queue per worker", inputs(800, prefill_inflight=8, prefill_healthy=16), "remote"),
    ("busy decode worker, long queue", inputs(800, prefill_inflight=8, decode_running=24), "remote"),
    ("busy decode worker, short prompt", inputs(20, decode_running=30), "remote"),
    ("busy by the gateway's fresher count", inputs(20, decode_running=2, decode_inflight=24), "remote"),
    ("decode worker below busy", inputs(20, decode_running=23), "local"),
    ("no prefill worker", inputs(800), "local"),
    ("no prefill worker, busy decode", inputs(800, decode_running=32), "local"),
])
def test_conditional_choices(case: str, state: PlacementInputs, expected: str) -> None:
    if case.startswith("no prefill worker"):
        state = PlacementInputs(state.prompt_tokens, state.cached_tokens, 0, 0, state.decode_running,
                                state.decode_inflight)
    assert warmed().place(state) == expected, case


def test_queue_estimate_grows_with_the_decode_load() -> None:
    """The same queue sends a long prompt local to an idle decode worker but not to a half-busy
    one: the stall a local prefill imposes grows with the batch it stalls."""
    policy = warmed()
    assert policy.place(inputs(800, prefill_inflight=3, prefill_healthy=2)) == "local"
    assert policy.place(inputs(800, prefill_inflight=3, prefill_healthy=2, decode_running=20)) == "remote"


def test_learned_prefill_time_moves_the_choice() -> None:
    """With 1 ms/token a 200-token prefill (0.2 s) dwarfs the 20 ms hop: remote. Once observed
    prefills show 10 us/token, the hop dominates the 2 ms compute: local."""
    policy = ConditionalPlacement(CONFIG)
    assert policy.place(inputs(200)) == "remote"
    for _ in range(60):
        policy.observe_prefill(1000, 0.03)  # 20 ms of it the hop: 10 ms of compute
    assert policy.s_per_token.value == pytest.approx(1e-5, rel=0.01)
    assert policy.place(inputs(200)) == "local"
    policy.observe_prefill(0, 1.0)  # nothing computed: nothing learned
    policy.observe_prefill(64, 1.0)  # under the threshold: mostly fixed costs, not learned from
    assert policy.s_per_token.value == pytest.approx(1e-5, rel=0.01)


def test_mean_remote_prompt_follows_what_was_sent_remote() -> None:
    policy = ConditionalPlacement(CONFIG)
    assert policy.remote_tokens.value == 64
    for _ in range(50):
        policy.place(inputs(500))
    assert policy.remote_tokens.value == pytest.approx(500, rel=0.01)
    policy.place(inputs(10))  # local: not part of the prefill queue's mean
    assert policy.remote_tokens.value == pytest.approx(500, rel=0.01)


def test_fixed_policies() -> None:
    assert AlwaysLocal().place(inputs(2000, prefill_inflight=0)) == "local"
    assert AlwaysRemote().place(inputs(2)) == "remote"
    assert AlwaysRemote().place(PlacementInputs(2, 0, 0, 0, 0, 0)) == "local"


def _count(placement: str) -> float:
    return REGISTRY.get_sample_value("pdserve_prefill_placement_total", {"placement": placement}) or 0.0


def test_make_placement_counts_each_decision() -> None:
    before = _count("local"), _count("remote")
    policy = make_placement("conditional", CONFIG)
    assert [policy.place(inputs(n)) for n in (10, 900, 30)] == ["local", "remote", "local"]
    assert (_count("local") - before[0], _count("remote") - before[1]) == (2, 1)
    assert make_placement("always-local").place(inputs(900)) == "local"
    assert make_placement("always-remote").place(inputs(9)) == "remote"
    policy.observe_prefill(1000, 0.03)  # reaches the conditional policy through the counter
    assert policy.inner.s_per_token.value < CONFIG.prefill_s_per_token


def test_bad_names_and_values_say_which_flag() -> None:
    with pytest.raises(ValueError, match="--disagg-policy must be one of always-remote, always-local"):
        make_placement("sometimes")
    with pytest.raises(ValueError, match="--disagg-busy-fraction"):
        DisaggConfig(busy_fraction=0)
    with pytest.raises(ValueError, match="--local-prefill-max-tokens"):
        DisaggConfig(local_max_tokens=-1)


def test_flags_round_trip() -> None:
    p = argparse.ArgumentParser()
    disagg.add_arguments(p)
    args = p.parse_args(["--disagg-policy", "always-local", "--local-prefill-max-tokens", "100",
                         "--disagg-prefill-ms-per-token", "2", "--disagg-remote-overhead-ms", "5"])
    config = disagg.config_from_args(args)
    assert (config.local_max_tokens, config.prefill_s_per_token, config.remote_overhead_s) == (100, 0.002, 0.005)
    assert isinstance(disagg.placement_from_args(args).inner, AlwaysLocal)
    # pdserve up forwards its own flags with its decode workers' batch size.
    forwarded = p.parse_args(list(disagg.gateway_flags(args, decode_batch=8)))
    assert disagg.config_from_args(forwarded) == DisaggConfig(
        local_max_tokens=100, decode_batch=8, prefill_s_per_token=0.002, remote_overhead_s=0.005)
    assert p.parse_args([]).disagg_policy == disagg.DEFAULT_POLICY


def test_gateway_setting_read_once() -> None:
    """Without flags a flow gets always-remote; with them each flow gets its own policy of the
    flags' kind (from the one GatewayConfig built at start); a bad value is refused at start."""
    from types import SimpleNamespace

    from gateway.config import GatewayConfig, add_arguments
    from gateway.limits import InflightLimit
    from gateway.server import build_flow

    pool = SimpleNamespace(routable_count=lambda: 1)

    def placement(settings: GatewayConfig | None):
        return build_flow(SimpleNamespace(), pool, pool, None, InflightLimit(1), settings).placement
    assert isinstance(placement(None).inner, AlwaysRemote)
    p = argparse.ArgumentParser()
    add_arguments(p)
    settings = GatewayConfig.from_args(
        p.parse_args(["--disagg-policy", "conditional", "--local-prefill-max-tokens", "7"]), {})
    first, second = placement(settings), placement(settings)
    assert first.inner is not second.inner and first.inner.config.local_max_tokens == 7
    with pytest.raises(ValueError, match="--disagg-decode-batch"):
        GatewayConfig.from_args(p.parse_args(["--disagg-decode-batch", "0"]), {})


# ---- on a real stack --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conditional_stack():
    from pdserve.stack import start_stack

    # 1 ms/token and a 20 ms hop: on an idle stack a 200-token prompt stays remote (0.22 s remote
    # vs 0.4 s local), a prompt of at most 32 tokens is local by the threshold.
    s = start_stack(1, 1, "--disagg-policy", "conditional", "--local-prefill-max-tokens", "32",
                    "--disagg-prefill-ms-per-token", "1", "--disagg-remote-overhead-ms", "20")
    yield s
    s.stop()


def test_stack_places_short_prompts_locally_and_long_ones_remotely(conditional_stack) -> None:
    """The prefill worker sees the long prompt and not the short one; both stream what the
    in-process engine generates greedily."""
    from conftest import STORIES_GGUF
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.v1 import common_pb2, gateway_pb2

    checkpoint = load_checkpoint(STORIES_GGUF)
    tok, engine = checkpoint.tokenizer, Engine.from_checkpoint(checkpoint)
    short = "Once upon a time"
    long = " ".join(["The little dog ran to the park and played with a red ball in the sun."] * 12)
    assert len(tok.encode(short)) <= 32 < 150 < len(tok.encode(long)) < 400
    stub = conditional_stack.gateway_stub()

    def generate(prompt: str) -> tuple[list[int], int]:
        """(token ids, prefills the prefill worker ran for it)."""
        before = conditional_stack.worker_stats("prefill-0").tokens_generated
        chunks = list(stub.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0)), timeout=120))
        after = conditional_stack.worker_stats("prefill-0").tokens_generated
        return [t for c in chunks for t in c.token_ids], after - before

    for prompt, remote_prefills in ((short, 0), (long, 1), (short, 0)):
        ids, prefills = generate(prompt)
        expected = engine.generate([tok.encode(prompt)], SamplingParams(max_tokens=24, temperature=0))[0].output_ids
        assert ids == expected, prompt[:20]
        assert prefills == remote_prefills, prompt[:20]
