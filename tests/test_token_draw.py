"""Batched token draws (pdserve.runtime.token_draw) against references written plainly here: the
inverse CDF against a float64 search of the whole row, and the draws' frequencies against the
distribution a softmax and a sort of the vocabulary give (the sampler's per-row path before the
batched one); a row's token does not depend on the rows drawn beside it."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime import token_draw
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.token_draw import draw_tokens, inverse_cdf

DRAWS = 60_000
MAX_TOTAL_VARIATION = 0.03  # sampling noise at DRAWS over <= 64 tokens is about 0.01


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> the filtered distribution, as a softmax, a sort and a cumulative sum give it."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    if p.top_p < 1.0:
        keep &= (sorted_p.cumsum(0) - sorted_p) < p.top_p * sorted_p.sum()
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_p[keep]
    return filtered / filtered.sum()


def frequencies(logits: torch.Tensor, p: SamplingParams, draws: int = DRAWS) -> torch.Tensor:
    """`draws` tokens of one row, drawn as that many rows of one call -> each token's share [V]."""
    tokens = draw_tokens(logits.expand(draws, -1), [p] * draws, [None] * draws)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double() / draws


@pytest.fixture
def logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(64) * 2


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=10, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.3),
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_follow_the_sorted_filter_distribution(logits, params):
    torch.manual_seed(1)
    seen, expected = frequencies(logits, params), reference_probs(logits, params)
    assert set(seen.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert 0.5 * float((seen - expected).abs().sum()) < MAX_TOTAL_VARIATION


def test_rows_that_keep_drawing_find_their_nucleus_by_a_sort(logits, monkeypatch):
    monkeypatch.setattr(token_draw, "MAX_ROUNDS", 0)  # every row outside its nucleus takes the sort
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.5)  # a nucleus of 4 tokens
    torch.manual_seed(2)
    seen, expected = frequencies(logits, params, draws=10_000), reference_probs(logits, params)
    assert set(seen.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert 0.5 * float((seen - expected).abs().sum()) < MAX_TOTAL_VARIATION


def test_a_large_top_k_is_found_by_selection(logits, monkeypatch):
    monkeypatch.setattr(token_draw, "TOPK_BELOW", 4)  # top_k 10 by kthvalue, top_k 3 by topk
    for params in (SamplingParams(temperature=1.0, top_k=10), SamplingParams(temperature=0.9, top_k=3, top_p=0.9)):
        torch.manual_seed(6)
        seen, expected = frequencies(logits, params, draws=20_000), reference_probs(logits, params)
        assert set(seen.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
        assert 0.5 * float((seen - expected).abs().sum()) < MAX_TOTAL_VARIATION


@pytest.mark.parametrize("vocab", [64, 300, 1024])  # 300: a vocabulary padded to whole chunks
def test_inverse_cdf_is_the_first_token_past_the_uniform(vocab):
    torch.manual_seed(vocab)
    weights = torch.rand(16, vocab) * (torch.rand(16, vocab) > 0.3)  # a third of the tokens at 0
    weights[3] = 0
    weights[3, vocab // 2] = 0.25  # one token alone
    uniforms = torch.rand(16, dtype=torch.float64)
    uniforms[0] = 0.0
    cdf = weights.double().cumsum(dim=-1)
    expected = [int((cdf[i] > uniforms[i] * cdf[i, -1]).nonzero()[0]) for i in range(16)]
    assert inverse_cdf(weights, uniforms).tolist() == expected
    assert inverse_cdf(weights, uniforms)[3] == vocab // 2


def test_a_target_past_its_chunks_float64_sum_draws_the_chunks_last_token_of_weight():
    weights = torch.zeros(2, 512)
    # fp32 rounds 1 + 0.75 ulp up to 1 + 1 ulp: the chunk's sum exceeds its tokens' float64 sum, and
    # a uniform just under one aims past them
    weights[0, [5, 9]] = torch.tensor([1.0, 0.75 * 2.0 ** -23])
    weights[1, [7, 100]] = torch.tensor([2.0, 0.5])
    tokens = inverse_cdf(weights, torch.full((2,), 1.0 - 2.0 ** -53, dtype=torch.float64))
    assert tokens.tolist() == [9, 100]


def test_a_row_draws_the_same_token_whatever_rows_are_drawn_beside_it(monkeypatch):
    torch.manual_seed(3)
    logits = torch.randn(len(PARAMS) * 2, 1000) * 3

    def seeded(seed: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(seed + i) for i in range(len(logits))]

    params = PARAMS * 2
    together = draw_tokens(logits, params, seeded(10))
    alone = [draw_tokens(logits[i:i + 1], [p], [g])[0] for i, (p, g) in enumerate(zip(params, seeded(10)))]
    assert together == alone
    monkeypatch.setattr(token_draw, "GROUP_BYTES", 3 * 4 * 1000)  # three rows a group
    assert draw_tokens(logits, params, seeded(10)) == together
    assert draw_tokens(logits, params, seeded(11)) != together  # the seed decides


def test_masked_tokens_are_never_drawn():
    torch.manual_seed(4)
    logits = torch.randn(4, 256)
    allowed = torch.zeros(4, 256, dtype=torch.bool)
    allowed[:, [3, 77, 200]] = True
    allowed[3] = False
    allowed[3, 9] = True  # one allowed token
    masked = logits.masked_fill(~allowed, float("-inf")).repeat(500, 1)  # [2000, 256]
    params = [SamplingParams(temperature=1.5), SamplingParams(temperature=0.5, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, min_p=0.5)] * 500
    tokens = draw_tokens(masked, params, [None] * len(params))
    assert set(tokens[i] for i in range(0, 2000, 4) if i % 4 == 3) <= {9}
    assert {t for i, t in enumerate(tokens) if i % 4 != 3} <= {3, 77, 200}
    assert [tokens[i] for i in range(3, 2000, 4)] == [9] * 500


def test_non_finite_logits_draw_a_finite_row():
    logits = torch.zeros(3, 128)
    logits[0, 17] = float("inf")  # the only token with weight: +inf clamps to the largest float
    logits[1, 5] = float("nan")
    logits[1, 40] = 50.0
    logits[2] = float("-inf")
    logits[2, 99] = 0.0
    tokens = draw_tokens(logits, [SamplingParams(temperature=0.5)] * 3, [None] * 3)
    assert tokens == [17, 40, 99]
