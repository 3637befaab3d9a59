"""Sampling: seeds reproduce, filters never let a token outside their set through; OpenAI's
presence/frequency penalties and logit_bias against a plain-Python reading of their formula."""

from __future__ import annotations

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.sampler import apply_logit_bias, apply_penalties, apply_repetition_penalty, sample, sample_one
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


# ---- presence / frequency penalties and logit_bias ------------------------------------------------

def reference_penalized(logits: list[float], generated: list[int], presence: float, frequency: float,
                        bias: dict[int, float]) -> list[float]:
    """OpenAI's documented formula, one token at a time: logit + bias - presence * (count > 0)
    - frequency * count, with count = occurrences of the token among the generated ones."""
    out = []
    for token, logit in enumerate(logits):
        count = generated.count(token)
        out.append(logit + bias.get(token, 0.0) - presence * (count > 0) - frequency * count)
    return out


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.7), (1.5, -0.5), (-2.0, 2.0)])
def test_penalties_follow_the_formula(logits, presence, frequency):
    generated = [3, 3, 3, 7, 9, 9, 63]
    ours = apply_penalties(logits, generated, presence, frequency)
    ref = reference_penalized(logits.tolist(), generated, presence, frequency, {})
    assert ours.tolist() == pytest.approx(ref, abs=1e-5)


def test_logit_bias_adds_to_the_listed_tokens(logits):
    bias = {0: 100.0, 5: -100.0, 63: 0.5}
    ours = apply_logit_bias(logits, tuple(bias.items()))
    assert ours.tolist() == pytest.approx(reference_penalized(logits.tolist(), [], 0, 0, bias), abs=1e-5)


def test_penalties_count_generated_tokens_only_a_resumed_tail_included(logits):
    """The prompt does not count; the tokens of a resumed stream's prompt that it generated do."""
    prompt, tail, outputs = [1, 2, 4], [4, 5], [5, 6]
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=1.5, logit_bias=((8, 3.0),))
    seq = Sequence("s", prompt + tail, params, output_ids=outputs, resumed_tokens=len(tail))
    assert seq.generated_ids == tail + outputs
    ref = reference_penalized(logits.tolist(), tail + outputs, 2.0, 1.5, {8: 3.0})
    assert sample_one(logits, seq) == max(range(len(ref)), key=ref.__getitem__)
    # And in a batch next to a plain greedy row, which keeps its own argmax.
    plain = Sequence("p", prompt, SamplingParams(temperature=0))
    rows = torch.stack([logits, logits])
    assert [t for t, _ in sample(rows, [seq, plain])] == [sample_one(logits, seq), int(logits.argmax())]


def test_engine_greedy_with_penalties_takes_the_reference_argmax_each_step(make_engine):
    """Every step's raw logits (kept by the engine) through the reference formula give the token
    the engine chose: the penalties see the tokens generated so far, from the first one on."""
    hf = random_hf_model("llama", seed=13)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    engine.keep_logits = True
    bias = {11: 1.5, 12: -2.0}
    params = SamplingParams(max_tokens=24, temperature=0, presence_penalty=0.8, frequency_penalty=0.6,
                            logit_bias=tuple(bias.items()), ignore_eos=True)
    seq = engine.add_request("r", [5, 6, 7], params)
    chosen = []
    while engine.has_unfinished():
        (out,) = engine.step()
        ref = reference_penalized(engine.last_logits[0].tolist(), chosen, 0.8, 0.6, bias)
        assert out.new_token_ids == [max(range(len(ref)), key=ref.__getitem__)]
        chosen += out.new_token_ids
    assert seq.output_ids == chosen
    plain = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert plain.output_ids != chosen  # the penalties did change the output


def test_a_large_logit_bias_forces_a_token_through_the_engine(make_engine):
    hf = random_hf_model("llama", seed=14)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, logit_bias=((42, 100.0),),
                                ignore_eos=True)
        assert engine.generate([[5, 6, 7]], params)[0].output_ids == [42] * 8
        banned = SamplingParams(max_tokens=8, temperature=0, logit_bias=((42, -100.0),), ignore_eos=True)
        assert 42 not in engine.generate([[5, 6, 7]], banned)[0].output_ids


@pytest.mark.parametrize("fields, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be between -2 and 2"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias needs"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias names a token id more than once"),
])
def test_bad_penalties_and_bias_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
