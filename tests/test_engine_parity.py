"""Our runtime against transformers on the same weights: logits and greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
TOL = 1e-4


def run_collecting_logits(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[torch.Tensor]]:
    """Runs to completion; returns, per request, the logits row of every sampled token."""
    engine.keep_logits = True
    ids = [engine.add_request(f"r{i}", p, params).request_id for i, p in enumerate(prompts)]
    rows: dict[str, list[torch.Tensor]] = {r: [] for r in ids}
    while engine.has_unfinished():
        outs = engine.step()
        for out, row in zip(outs, engine.last_logits):
            rows[out.request_id].append(row.clone())
    return rows


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers_prefill_and_32_decode_steps(make_engine, architecture):
    hf = random_hf_model(architecture)
    engine = make_engine(model_config_from_hf(hf.config, architecture), hf.state_dict())
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 160) for _ in range(n)] for n in (7, 23, 40)]
    rows = run_collecting_logits(engine, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        ours = torch.stack(rows[f"r{i}"])  # [33, V]: prefill row, then 32 decode rows
        seq_tokens = prompt + ours.argmax(-1).tolist()[:-1]
        ref = reference_logits(hf, seq_tokens)[len(prompt) - 1:]  # [33, V]
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff <= TOL, f"{architecture} prompt {i}: max |logit diff| {diff:.2e} > {TOL}"


def test_tied_embeddings_match_transformers(make_engine):
    hf = random_hf_model("llama", tie_word_embeddings=True)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    prompt = list(range(3, 30))
    rows = run_collecting_logits(engine, [prompt], SamplingParams(max_tokens=1, temperature=0))
    ref = reference_logits(hf, prompt)[-1]
    assert (rows["r0"][0] - ref).abs().max().item() <= TOL


def test_greedy_tokens_match_transformers_generate(make_engine):
    hf = random_hf_model("llama", seed=3)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    prompts = [[5, 9, 13], list(range(20, 58))]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    seqs = engine.generate(prompts, params)
    for prompt, seq in zip(prompts, seqs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == ref
