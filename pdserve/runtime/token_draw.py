"""Drawing the next token of many sampled rows at once: temperature, min-p, top-k and top-p over the
whole vocabulary with no per-row softmax, sort or `torch.multinomial`.

Why: the per-row path (a softmax, the filters by a sort of the vocabulary, `torch.multinomial`) cost
1.2 ms a row over SmolLM2's 49152 tokens on one thread of a 2-core Xeon: 38 ms for 32 rows at
temperature 0.7 and 145 ms with top_p 0.95 (a sort a row), against 57 ms for the 32-sequence decode
step that made the logits. Here, for R rows at once:

- weights = exp((l - max) / T), [R, V]: the softmax's numerators. No normalisation: min-p compares a
  weight with a share of its row's largest, which is exp(0) = 1, top-p with a share of the row's
  total, and the draw scales its uniform by the total.
- the draw: the inverse of the cumulative distribution in two levels (the sums of chunks of CHUNK
  tokens, then the chosen chunk's tokens), in float64, one uniform a draw from the row's generator.
- min-p and top-k are thresholds on the weights (min_p itself; a row's k-th largest weight, from
  one `topk`: a token is among the k most likely exactly when fewer than k tokens weigh more).
- top-p without a sort, as FlashInfer's GPU sampling kernels do: a drawn token x is in the nucleus
  exactly when the tokens weighing more than it hold less than top_p of the mass. When it is not, no
  token weighing at most x's weight is (at least as much weighs more than each), so the row draws
  again among the heavier tokens only. The set drawn from always holds the whole nucleus, so an
  accepted token is distributed as the nucleus. A row still drawing after MAX_ROUNDS finds its
  nucleus by a sort.

Ties: a token whose weight equals the k-th largest is kept (a sort keeps exactly k, equal weights in
whatever order it leaves them); a token is in the nucleus when the tokens weighing strictly more
hold less than top_p of the mass.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.runtime.compute_threads import one_thread
from pdserve.runtime.sampling_params import SamplingParams

CHUNK = 256  # tokens a chunk of the two-level draw
MAX_ROUNDS = 32  # draws a row makes before its nucleus is found by a sort
# Rows drawn together: their weights ([rows, V] fp32) stay in a core's L2 cache over the passes
# (32 rows of SmolLM2 at temperature 0.7, one thread: 5.0 ms all at once, 6 MB; 2.9 in groups of 5).
GROUP_BYTES = 1 << 20
TOPK_BELOW = 1024  # top-k of at most this many tokens by `topk`; more by a selection (`_kth_weights`)


def weights_of(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, V], temperature [R] > 0 -> exp((l - max) / T) [R, V], each row's largest 1.

    A masked (-inf) logit's weight is exactly 0, as in a softmax, so it is never drawn. A row with a
    NaN or +inf logit is clamped to finite values first (NaN to 0), so that a tiny temperature gives
    0 for unlikely tokens, never NaN; the check is the row's max, which either makes non-finite."""
    largest = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    if not bool(torch.isfinite(largest).all()):
        info = torch.finfo(logits.dtype)
        logits = torch.nan_to_num(logits, posinf=info.max, neginf=info.min)
        largest = logits.amax(dim=-1, keepdim=True)
    return (logits - largest).div_(temperature.to(logits.dtype)[:, None]).exp_()


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0, each row's sum positive; uniforms [R] float64 in [0, 1) -> [R] int64:
    per row the first token whose cumulative weight exceeds uniform x total (a token of weight 0 is
    never the answer)."""
    rows, vocab = weights.shape
    padded = -vocab % CHUNK
    if padded:
        weights = torch.nn.functional.pad(weights, (0, padded))
    chunks = weights.view(rows, -1, CHUNK)  # [R, C, CHUNK]
    chunk_cdf = chunks.sum(dim=-1).double().cumsum_(dim=-1)  # [R, C]
    target = uniforms.to(chunk_cdf.device) * chunk_cdf[:, -1]  # [R]
    chunk = torch.searchsorted(chunk_cdf, target[:, None], right=True).clamp_(max=chunk_cdf.shape[1] - 1)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp_(min=0)), 0.0)[:, 0]  # [R]
    inside = chunks[torch.arange(rows, device=weights.device), chunk[:, 0]]  # [R, CHUNK], the chosen chunks' weights
    inside_cdf = inside.double().cumsum_(dim=-1)
    offset = torch.searchsorted(inside_cdf, (target - before)[:, None], right=True)[:, 0]  # [R]
    # A target past its chunk's sum (the fp32 chunk sum rounds above the float64 one) lands on the
    # chunk's last token of positive weight.
    past = offset >= CHUNK
    if bool(past.any()):
        last = CHUNK - 1 - (inside > 0).flip(-1).int().argmax(dim=-1)
        offset = torch.where(past, last, offset)
    return chunk[:, 0] * CHUNK + offset


def uniforms_of(generators: Seq[torch.Generator | None]) -> torch.Tensor:
    """One uniform in [0, 1) a row [R] float64: from the row's generator where it has one (a seeded
    request: a function of its seed and position), else from torch's default generator."""
    unseeded = iter(torch.rand(sum(g is None for g in generators), dtype=torch.float64).tolist())
    return torch.tensor([next(unseeded) if g is None else float(torch.rand(1, dtype=torch.float64, generator=g))
                         for g in generators], dtype=torch.float64)


def draw_tokens(logits: torch.Tensor, params: Seq[SamplingParams],
                generators: Seq[torch.Generator | None]) -> list[int]:
    """logits [R, V] fp32 (the grammar mask, logit bias and penalties applied), each row's params
    with temperature > 0, its generator (None: unseeded) -> one token a row. Rows are drawn a few
    at a time, so that their weights stay in the core's cache over the passes (a row's token does
    not depend on the others), on the calling thread alone: each op is 10-50 us on a group, and
    split over two threads it waits for the other at its end (32 rows of SmolLM2 at top_p 0.95 beside
    a busy core: 8.2 ms on two threads, 4.2 on one; 3.2 on two with both cores free)."""
    group = max(1, GROUP_BYTES // (logits.element_size() * logits.shape[1]))
    tokens: list[int] = []
    with one_thread():
        for start in range(0, len(params), group):
            end = start + group
            tokens += _draw_group(logits[start:end], params[start:end], generators[start:end])
    return tokens


def _draw_group(logits: torch.Tensor, params: Seq[SamplingParams], generators: Seq[torch.Generator | None]
                ) -> list[int]:
    weights = weights_of(logits, torch.tensor([p.temperature for p in params], device=logits.device))  # [G, V]
    if any(p.min_p > 0 for p in params):
        _keep_from(weights, [p.min_p for p in params])  # the row's largest weight is 1
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    mass_limits = None if not nucleus else (  # top-p's share of the mass before top-k, as a sort's
        torch.tensor([params[i].top_p for i in nucleus], device=logits.device) * weights.sum(dim=-1)[nucleus])
    if any(0 < p.top_k < weights.shape[1] for p in params):
        _keep_from(weights, _kth_weights(weights, params))
    tokens = inverse_cdf(weights, uniforms_of(generators))  # [G]
    if nucleus:
        _redraw_outside_nucleus(weights, tokens, torch.tensor(nucleus, device=logits.device), mass_limits, generators)
    return tokens.tolist()


def _kth_weights(weights: torch.Tensor, params: Seq[SamplingParams]) -> list[float]:
    """weights [G, V] -> each row's k-th largest weight (0 for a row without top-k). A token is among
    a row's k most likely exactly when its weight is at least that: fewer than k weigh more. Small
    k by one `topk` over those rows; a larger k by a selection a row (`kthvalue`, linear in V), so
    that a request's top_k of half the vocabulary costs a pass, not a sort."""
    vocab = weights.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    kth = [0.0] * len(ks)
    small = [i for i, k in enumerate(ks) if 0 < k <= TOPK_BELOW]
    if small:
        largest = weights[small].topk(max(ks[i] for i in small), dim=-1).values  # [S, max k], descending
        places = torch.tensor([ks[i] - 1 for i in small], device=weights.device)[:, None]
        picked = largest.gather(1, places)[:, 0].tolist()
        for i, value in zip(small, picked):
            kth[i] = value
    for i, k in enumerate(ks):
        if k > TOPK_BELOW:
            kth[i] = float(weights[i].kthvalue(vocab - k + 1).values)  # the (V - k + 1)-th smallest
    return kth


def _keep_from(weights: torch.Tensor, limits: list[float]) -> None:
    """weights [G, V] >= 0, in place: each row's weights under its limit set to 0 (a limit <= 0: none).
    `threshold_` keeps the weights above the float just under the limit, i.e. from the limit on: one
    vectorised pass a row, several times faster than a comparison and a `where` over the group."""
    limit = torch.tensor(limits, dtype=weights.dtype)  # on the host: threshold_ takes numbers
    under = torch.nextafter(limit, torch.tensor(float("-inf"), dtype=weights.dtype))
    for row, limit, below in zip(weights, limits, under.tolist()):
        if limit > 0:
            torch.nn.functional.threshold_(row, below, 0.0)


def _redraw_outside_nucleus(weights: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
                            mass_limits: torch.Tensor, generators: Seq[torch.Generator | None]) -> None:
    """weights [G, V] (top-k applied); tokens [G], drawn from them, changed in place where a row's
    top-p leaves its token out (top_p of the mass, `mass_limits` [P], weighs more than it): the row
    draws again among the tokens heavier than it, until one is in. rows [P]: the top-p rows. Tokens
    heavier than a top-k row's token are all among its k, so their mass is the whole row's too."""
    full = weights if len(rows) == len(weights) else weights[rows]  # [P, V]
    drawn = tokens[rows]
    for _ in range(MAX_ROUNDS):
        heavier = full.clone()  # [P, V]: each row's tokens heavier than its draw, the rest 0
        for row, weight in zip(heavier, full.gather(1, drawn[:, None])[:, 0].tolist()):
            torch.nn.functional.threshold_(row, weight, 0.0)
        out = heavier.sum(dim=-1) >= mass_limits  # [P] bool
        if not bool(out.any()):
            return
        rows, full, heavier, mass_limits = rows[out], full[out], heavier[out], mass_limits[out]
        drawn = inverse_cdf(heavier, uniforms_of([generators[i] for i in rows.tolist()]))  # again, among them
        tokens[rows] = drawn
    for j, i in enumerate(rows.tolist()):  # still drawing: the nucleus by a sort, then one draw from it
        sorted_w, order = weights[i].sort(descending=True)
        kept = max(1, int(((sorted_w.cumsum(0) - sorted_w) < mass_limits[j]).sum()))  # a prefix
        tokens[i] = order[inverse_cdf(sorted_w[None, :kept], uniforms_of([generators[i]]))[0]]
