"""Speculative decoding by prompt n-gram lookup: exactly the output of plain decoding.

Greedy and seeded output token for token, the sampled distribution by a chi-square test, against
the same engine with speculation off; blocks of rejected drafts released and never hashed."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from conftest import STORIES_GGUF, model_config_from_hf, random_hf_model
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.speculative import NgramIndex, SpeculativeConfig

SPEC = SpeculativeConfig(num_tokens=4, max_batch_size=64)
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, Lily saw a big red ball. Once upon a time, there was a little girl named")


@pytest.fixture(scope="module")
def stories():
    return load_checkpoint(STORIES_GGUF)


def _run(engine, prompts: list[list[int]], params: list[SamplingParams], spec: SpeculativeConfig | None):
    """Runs the prompts together; returns each one's (tokens, finish reason, logprobs) and checks
    after every step that no sequence keeps blocks past its tokens (rejected drafts' slots)."""
    engine.set_speculative(spec or SpeculativeConfig())
    seqs = [engine.add_request(f"r{i}-{id(spec)}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            assert len(s.block_table) <= engine.block_manager.blocks_for(s.num_tokens)
    engine.check_leaks()
    return [(s.output_ids, s.finish_reason, [(lp.token_id, round(lp.logprob, 4)) for lp in s.logprobs]) for s in seqs]


def _story_prompts(stories) -> list[list[int]]:
    rng = random.Random(0)
    tok = stories.tokenizer
    return [tok.encode(STORY), tok.encode("Tom had a dog. The dog was big. Tom had a cat. The cat was"),
            [rng.randrange(3, stories.config.vocab_size) for _ in range(37)], tok.encode("Lily")]


@pytest.mark.parametrize("block_size,num_blocks", [(4, 256), (16, 256), (4, 40)])
def test_greedy_equals_plain_batched_across_blocks(make_engine, stories, block_size, num_blocks):
    """Repeating and non-repeating prompts in one batch; tiny blocks so drafts cross block
    boundaries; 40 blocks of 4 tokens are too few for all at once (preemption, no draft headroom)."""
    engine = make_engine(stories.config, stories.weights, block_size=block_size, num_blocks=num_blocks)
    prompts = _story_prompts(stories)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (60, 45, 30, 50)]
    plain = _run(engine, prompts, params, None)
    before = engine.stats.spec_accepted_tokens
    assert _run(engine, prompts, params, SPEC) == plain
    assert engine.stats.spec_accepted_tokens > before, "no draft was accepted: the test checks nothing"
    assert engine.stats.spec_draft_tokens > engine.stats.spec_accepted_tokens, "no draft was rejected"


def test_max_tokens_stop_tokens_and_eos_mid_draft(make_engine, stories):
    engine = make_engine(stories.config, stories.weights, block_size=4)
    prompt = _story_prompts(stories)[0]
    full = _run(engine, [prompt], [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)], None)[0][0]
    stop_at = full[12]  # a token the output reaches after drafts were accepted
    cases = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 3, 7, 13)]
    cases += [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_at,)),
              SamplingParams(max_tokens=40, temperature=0)]  # eos, where the model emits it
    plain = _run(engine, [prompt] * len(cases), cases, None)
    assert _run(engine, [prompt] * len(cases), cases, SPEC) == plain
    assert plain[5][1] == "stop" and plain[5][0][-1] == stop_at


def test_penalties_and_logprobs_equal_plain(make_engine, stories):
    """Each row sees the tokens accepted before it: penalties count them as plain decoding does."""
    engine = make_engine(stories.config, stories.weights, block_size=8)
    prompts = _story_prompts(stories)[:2]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3, logit_bias=((13, 2.0),))]
    assert _run(engine, prompts, params, SPEC) == _run(engine, prompts, params, None)


def test_seeded_sampling_equals_plain_token_for_token(make_engine, stories):
    """The draw at each position comes from the position's seeded generator in both modes."""
    engine = make_engine(stories.config, stories.weights, block_size=4)
    prompts = _story_prompts(stories)
    params = [SamplingParams(max_tokens=40, temperature=t, top_p=0.9, top_k=k, seed=s, ignore_eos=True)
              for t, k, s in ((0.3, 0, 1), (0.7, 20, 2), (1.0, 0, 3), (0.5, 5, 4))]
    before = engine.stats.spec_accepted_tokens
    assert _run(engine, prompts, params, SPEC) == _run(engine, prompts, params, None)
    assert engine.stats.spec_accepted_tokens > before


def _chi_square_p(a: list[int], b: list[int]) -> float:
    """p-value of the chi-square test that samples `a` and `b` come from one distribution (cells
    with fewer than 10 draws in all merged into one)."""
    cells = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(c), b.count(c)] for c in cells], dtype=torch.float64)
    rare = counts.sum(1) < 10
    counts = torch.cat([counts[~rare], counts[rare].sum(0, keepdim=True)]) if rare.any() else counts
    counts = counts[counts.sum(1) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((counts.shape[0] - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def test_sampled_distribution_equals_plain(make_engine):
    """Unseeded sampling on a 12-token vocabulary: the distribution of the first four tokens (the
    2nd on drawn in verify steps where drafts are accepted or rejected; cells: position x token)
    with speculation equals plain sampling's (two-sample chi-square, generous threshold). It
    catches gross errors (a wrong acceptance rule); token-for-token exactness is the seeded test's."""
    hf = random_hf_model("llama", seed=5, vocab_size=12)
    with torch.no_grad():
        hf.lm_head.weight.mul_(5.0)  # peaked, not degenerate: a wrong acceptance rule would show
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict(), block_size=4,
                         num_blocks=1024, max_num_seqs=128, max_num_batched_tokens=1024)  # room for every draft
    torch.manual_seed(0)
    prompt, n = [5, 6, 7] + list(range(12)) + [5, 6], 500  # every token seen before: always a draft
    params = [SamplingParams(max_tokens=4, temperature=0.8, ignore_eos=True)] * n
    plain = [out for out, _, _ in _run(engine, [prompt] * n, params, None)]
    before = (engine.stats.spec_draft_tokens, engine.stats.spec_accepted_tokens, engine.stats.spec_verifies)
    spec = [out for out, _, _ in _run(engine, [prompt] * n, params, SpeculativeConfig(num_tokens=3,
                                                                                        max_batch_size=n))]
    drafted, accepted = engine.stats.spec_draft_tokens - before[0], engine.stats.spec_accepted_tokens - before[1]
    assert 0 < accepted < drafted, (accepted, drafted)
    assert engine.stats.spec_verifies - before[2] >= n  # most tokens after the first come from verify steps
    cells = lambda outs: [(i, t) for o in outs for i, t in enumerate(o)]  # noqa: E731 - (position, token)
    p = _chi_square_p(cells(plain), cells(spec))
    assert p > 1e-3, f"the first four tokens' distributions differ (chi-square p = {p:.2e})"


def test_drafts_are_never_hashed_and_off_above_max_batch(make_engine, stories):
    engine = make_engine(stories.config, stories.weights, block_size=4)
    other = make_engine(stories.config, stories.weights, block_size=4)
    prompts = _story_prompts(stories)[:2]
    params = [SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)] * 2
    _run(engine, prompts, params, SPEC)
    _run(other, prompts, params, None)
    assert engine.resident() == other.resident()  # the same full blocks, nothing of a rejected draft
    verifies = engine.stats.spec_verifies
    _run(engine, prompts * 2, params * 2, SpeculativeConfig(num_tokens=4, max_batch_size=3))
    assert engine.stats.spec_verifies == verifies  # 4 streams > 3: no speculation


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 2, 3]
    assert index.propose(tokens, 2) == [8, 7]  # "7 2 3" never seen before; "2 3" last before 8 7
    assert index.propose(tokens + [5], 4) == []  # 5 was never seen
    assert NgramIndex(1, 3).propose([4, 4, 4, 4], 3) == [4]  # the latest earlier "4 4 4" ends one before the end


def test_flags_build_the_config():
    from pdserve.engine_args import add_engine_args, speculative_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert not speculative_config_from_args(p.parse_args([])).enabled
    config = speculative_config_from_args(p.parse_args(["--speculative-ngram", "5", "--speculative-max-batch", "2"]))
    assert (config.num_tokens, config.max_batch_size) == (5, 2)
