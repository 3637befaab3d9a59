"""The real stories260K TinyStories model: our runtime against transformers loading the same GGUF."""

from __future__ import annotations

import pytest
import torch

from conftest import STORIES_GGUF
from hf_reference import load_hf_gguf_model
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams

PROMPTS = [
    "Once upon a time",
    "Lily and her brother Tom went to the park. They saw a big",
    "The little dog was sad because",
]
# Greedy continuation of "Once upon a time" (the same as transformers gives on this file, which
# the parity tests check): a golden output that any machine reproduces in a second.
GOLDEN_PREFIX = ", there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return load_hf_gguf_model(STORIES_GGUF, tmp_path_factory.mktemp("gguf"))


@pytest.fixture
def engine(checkpoint):
    e = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=512)))
    yield e
    e.check_leaks()


def test_logits_match_transformers_prefill_and_32_decode_steps(engine, checkpoint, hf):
    engine.keep_logits = True
    prompt = checkpoint.tokenizer.encode(PROMPTS[1])
    engine.add_request("r", prompt, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
    rows = []
    while engine.has_unfinished():
        engine.step()
        rows.append(engine.last_logits[0].clone())
    ours = torch.stack(rows)  # [33, V]
    tokens = prompt + ours.argmax(-1).tolist()[:-1]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, len(prompt) - 1:].float()
    assert (ours - ref).abs().max().item() <= 1e-4


def test_greedy_100_tokens_match_transformers_generate(engine, checkpoint, hf):
    tok = checkpoint.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    seqs = engine.generate(prompts, params)
    for prompt, seq in zip(prompts, seqs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=100, min_new_tokens=100, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == ref, tok.decode(seq.output_ids)


def test_golden_greedy_text(engine, checkpoint):
    tok = checkpoint.tokenizer
    prompt = tok.encode(PROMPTS[0])
    seq = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert tok.decode(seq.output_ids).startswith(GOLDEN_PREFIX)


def test_prompt_longer_than_the_context_window_is_refused(engine, checkpoint):
    from pdserve.runtime.engine import RequestError

    window = checkpoint.config.max_position_embeddings
    with pytest.raises(RequestError, match=f"exceeds the context window of {window} tokens"):
        engine.add_request("long", [5] * window, SamplingParams(max_tokens=1))
