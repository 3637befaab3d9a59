"""Continuous batching, chunked prefill, prefix reuse and preemption give unbatched results."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.engine import QueueFullError, RequestError
from pdserve.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return random_hf_model("llama", seed=7)


def _engine(make_engine, hf, **kw):
    return make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict(), **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([3, 5, 17, 21, 31, 33, 47, 50]) for _ in range(n)]
    return [[rng.randrange(3, 160) for _ in range(k)] for k in lengths]


def _solo(make_engine, hf, prompts, params=GREEDY) -> list[list[int]]:
    engine = _engine(make_engine, hf)
    return [engine.generate([p], params)[0].output_ids for p in prompts]


def test_batched_equals_unbatched_with_scattered_blocks(make_engine, hf):
    prompts = _prompts(12)
    expected = _solo(make_engine, hf, prompts)
    engine = _engine(make_engine, hf)
    random.Random(5).shuffle(engine.block_manager._free)  # scatter block tables on purpose
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    tables = []
    while engine.has_unfinished():
        engine.step()
        tables += [list(s.block_table) for s in seqs if len(s.block_table) > 1]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "blocks were not scattered"
    assert [s.output_ids for s in seqs] == expected
    assert engine.stats.max_batch_size == 12


def test_requests_join_and_leave_between_steps(make_engine, hf):
    prompts = _prompts(6, seed=1)
    expected = _solo(make_engine, hf, prompts)
    engine = _engine(make_engine, hf)
    seqs = []
    for i, p in enumerate(prompts):  # a new request arrives every two steps
        seqs.append(engine.add_request(f"r{i}", p, GREEDY))
        engine.step()
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == expected


def test_chunked_prefill_equals_whole_prefill(make_engine, hf):
    prompts = _prompts(5, seed=2)
    expected = _solo(make_engine, hf, prompts)
    engine = _engine(make_engine, hf, max_num_batched_tokens=16)
    assert [s.output_ids for s in engine.generate(prompts, GREEDY)] == expected


def test_preemption_by_recompute_keeps_outputs(make_engine, hf):
    prompts = _prompts(8, seed=3)
    expected = _solo(make_engine, hf, prompts)
    engine = _engine(make_engine, hf, num_blocks=12)  # too few blocks for all at once
    seqs = engine.generate(prompts, GREEDY)
    assert [s.output_ids for s in seqs] == expected


def test_prefix_reuse_computes_only_the_suffix(make_engine, hf):
    rng = random.Random(9)
    prefix = [rng.randrange(3, 160) for _ in range(40)]
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14, 15]
    engine = _engine(make_engine, hf)
    engine.keep_logits = True
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0))
    seq = engine.add_request("second", second, SamplingParams(max_tokens=1, temperature=0))
    computed_before = engine.stats.tokens_computed
    engine.step()
    reused_logits = engine.last_logits[0].clone()
    assert seq.num_cached_tokens == 32  # two full 16-token blocks of the shared 40-token prefix
    assert engine.stats.tokens_computed - computed_before == len(second) - 32

    fresh = _engine(make_engine, hf)
    fresh.keep_logits = True
    fresh.generate([second], SamplingParams(max_tokens=1, temperature=0))
    assert torch.allclose(reused_logits, fresh.last_logits[0], atol=1e-5)


def test_fully_cached_prompt_still_computes_its_last_token(make_engine, hf):
    prompt = list(range(3, 35))  # exactly two blocks
    engine = _engine(make_engine, hf)
    a = engine.generate([prompt], GREEDY)[0].output_ids
    seq = engine.generate([prompt], GREEDY)[0]
    assert seq.num_cached_tokens == 16 and seq.output_ids == a


def test_abort_frees_blocks(make_engine, hf):
    engine = _engine(make_engine, hf)
    engine.add_request("keep", _prompts(1)[0], GREEDY)
    engine.add_request("drop", list(range(3, 60)), GREEDY)
    engine.step()
    assert engine.abort("drop")
    assert not engine.abort("drop")
    while engine.has_unfinished():
        engine.step()


def test_bad_requests_are_refused_with_a_clear_message(make_engine, hf):
    engine = _engine(make_engine, hf)
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(RequestError, match="exceeds the context window of 512 tokens"):
        engine.add_request("b", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match=r"token ids must be in \[0, 160\)"):
        engine.add_request("c", [5, 999], GREEDY)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    assert not engine.has_unfinished()


def test_bounded_waiting_queue(make_engine, hf):
    from dataclasses import replace

    engine = _engine(make_engine, hf)
    engine.config = replace(engine.config, scheduler=replace(engine.config.scheduler, max_waiting=2))
    engine.add_request("a", [5, 6], GREEDY)
    engine.add_request("b", [5, 6], GREEDY)
    with pytest.raises(QueueFullError, match="retry later"):
        engine.add_request("c", [5, 6], GREEDY)
    engine.abort("a")
    engine.abort("b")
