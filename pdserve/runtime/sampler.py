"""Sampler: logits of the sequences that reached their last token -> next tokens.

Filters apply in vLLM's order: repetition penalty, temperature, top-k, top-p, min-p.
Returned logprobs are those of the model's raw distribution (before filters).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.runtime.sequence import Sequence, TokenLogprob


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[int], penalty: float) -> torch.Tensor:
    """logits: [V]; divides positive, multiplies negative logits of seen tokens (CTRL rule)."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """probs: [V] -> the renormalised distribution with tokens outside the filters at 0."""
    if min_p > 0:
        probs = torch.where(probs < min_p * probs.max(), 0.0, probs)
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        before = sorted_p.cumsum(0) - sorted_p  # mass of strictly more likely tokens
        keep &= before < top_p * sorted_p.sum()
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_p[keep]
    return filtered / filtered.sum()


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [V] -> logits / temperature, computed so that it cannot overflow into NaN: clamped
    to finite values and shifted to a maximum of 0 first (softmax does not change under a shift),
    so a tiny temperature or repetition penalty gives -inf for unlikely tokens, never inf - inf."""
    info = torch.finfo(logits.dtype)
    finite = torch.nan_to_num(logits, posinf=info.max, neginf=info.min)
    return (finite - finite.max()) / temperature


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """logits: [V] fp32 of one sequence -> the next token id."""
    p = seq.params
    logits = apply_repetition_penalty(logits, seq.token_ids, p.repetition_penalty)
    if p.greedy:
        return int(logits.argmax())
    probs = torch.softmax(scaled_logits(logits, p.temperature), dim=-1)
    probs = filter_probs(probs, p.top_k, p.top_p, p.min_p)
    return int(torch.multinomial(probs, 1, generator=seq.generator()))


def top_logprobs(logprobs: torch.Tensor, token_id: int, n: int) -> TokenLogprob:
    """logprobs: [V] -> the chosen token's logprob plus the n most likely alternatives."""
    values, ids = logprobs.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
    top = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def sample(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [S, V] fp32, one row per sequence -> (token id, logprob or None) each."""
    all_greedy_plain = all(s.params.greedy and s.params.repetition_penalty == 1.0 for s in seqs)
    if all_greedy_plain:
        tokens = logits.argmax(dim=-1).tolist()
    else:
        tokens = [sample_one(row, seq) for row, seq in zip(logits, seqs)]
    results: list[tuple[int, TokenLogprob | None]] = []
    for row, seq, tok in zip(logits, seqs, tokens):
        lp = None
        if seq.params.logprobs:
            lp = top_logprobs(torch.log_softmax(row, dim=-1), tok, seq.params.logprobs)
        results.append((tok, lp))
    return results
