"""Sampling: seeds reproduce, filters never let a token outside their set through."""

from __future__ import annotations

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.sampler import apply_repetition_penalty, sample_one
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import Sequence

DRAWS = 2000


def _draws(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    seq = Sequence("s", [1], params)
    return {sample_one(logits, seq) for _ in range(DRAWS)}


def _allowed_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    """Reference: most likely tokens, in order, until their mass reaches top_p."""
    allowed, mass = set(), 0.0
    for p, i in sorted(zip(probs.tolist(), range(len(probs))), reverse=True):
        allowed.add(i)
        mass += p
        if mass >= top_p:
            break
    return allowed


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(64) * 2


def test_top_k_never_leaves_the_k_most_likely(logits):
    seen = _draws(logits, SamplingParams(temperature=1.0, top_k=5))
    assert seen <= set(logits.topk(5).indices.tolist())
    assert len(seen) > 1


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_never_leaves_the_nucleus(logits, top_p):
    seen = _draws(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert seen <= _allowed_top_p(torch.softmax(logits, -1), top_p)


def test_min_p_drops_unlikely_tokens(logits):
    probs = torch.softmax(logits, -1)
    seen = _draws(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert seen <= set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())


def test_temperature_zero_is_argmax(logits):
    assert _draws(logits, SamplingParams(temperature=0)) == {int(logits.argmax())}


def test_repetition_penalty_follows_the_ctrl_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_seeded_sampling_reproduces_through_the_engine(make_engine):
    hf = random_hf_model("llama", seed=11)
    config = model_config_from_hf(hf.config, "llama")
    prompt = [5, 6, 7, 8, 9]

    def run(seed: int) -> list[int]:
        engine = make_engine(config, hf.state_dict())
        params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        # Another unseeded request in the same batch must not disturb the seeded one.
        engine.add_request("noise", [9, 8, 7], SamplingParams(max_tokens=40, temperature=1.0))
        return engine.generate([prompt], params)[0].output_ids

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_logprobs_are_log_softmax_of_the_logits(make_engine):
    hf = random_hf_model("llama", seed=12)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    prompt = [5, 6, 7]
    seq = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
    lp = seq.logprobs[0]
    assert lp.token_id == int(ref.argmax())
    assert abs(lp.logprob - float(ref.max())) < 1e-4
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_sampling_values_are_refused(field, value):
    # Found by fuzzing the gateway: NaN passed validation and failed the worker's engine step.
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-30),
                                    SamplingParams(temperature=1.0, repetition_penalty=1e-40)])
def test_tiny_temperature_or_penalty_samples_without_nan(logits, params):
    # Found by fuzzing: logits / 1e-40 overflowed to inf and softmax gave NaN (engine step failed).
    seq = Sequence("s", [int(logits.argmax())], params)
    token = sample_one(logits, seq)
    assert 0 <= token < len(logits)
