"""Sampler: logits of the sequences that reached their last token -> next tokens.

Logits are processed in vLLM's order: the grammar's allowed-token mask (structured output:
disallowed tokens to -inf), logit_bias, repetition penalty, presence and frequency penalties,
then temperature, min-p, top-k and top-p, every sampled row of a step drawn in one batch
(`token_draw`). Returned logprobs are those of the model's raw distribution (before the mask and
filters). Plain greedy rows (no bias or penalty) are one max.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from pdserve.runtime.compute_threads import one_thread
from pdserve.runtime.kernels import cpu_layer_ops
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import Sequence, TokenLogprob
from pdserve.runtime.token_draw import draw_tokens


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[int], penalty: float) -> torch.Tensor:
    """logits: [V]; divides positive, multiplies negative logits of seen tokens (CTRL rule)."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def apply_penalties(logits: torch.Tensor, generated: Seq[int], presence: float, frequency: float) -> torch.Tensor:
    """logits: [V] -> logits - presence * (count > 0) - frequency * count, with `count` each
    token's occurrences in `generated` (OpenAI's presence and frequency penalties)."""
    if (presence == 0 and frequency == 0) or not generated:
        return logits
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0])
    counts = counts[:logits.shape[0]].to(logits.device, logits.dtype)  # [V]
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def apply_logit_bias(logits: torch.Tensor, bias: Seq[tuple[int, float]]) -> torch.Tensor:
    """logits: [V] -> logits with each (token id, bias) added (a repeated id adds up)."""
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
    return logits.index_add(0, ids, values)


def processed_logits(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logits: [V] of one sequence (its grammar mask already applied) -> with its logit_bias and
    penalties applied: what greedy takes the argmax of and sampling the softmax of."""
    p = seq.params
    logits = apply_logit_bias(logits, p.logit_bias)
    logits = apply_repetition_penalty(logits, seq.token_ids, p.repetition_penalty)
    return apply_penalties(logits, seq.generated_ids, p.presence_penalty, p.frequency_penalty)


def sample_one(logits: torch.Tensor, seq: Sequence) -> int:
    """logits: [V] fp32 of one sequence (its grammar mask applied) -> the next token id, drawn as
    `sample` draws it in a batch."""
    return _tokens(logits[None], [seq])[0]


def top_logprobs(logprobs: torch.Tensor, token_id: int, n: int) -> TokenLogprob:
    """logprobs: [V] -> the chosen token's logprob plus the n most likely alternatives."""
    values, ids = logprobs.topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
    top = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return TokenLogprob(token_id, float(logprobs[token_id]), top)


def argmax_tokens(rows: torch.Tensor) -> list[int]:
    """rows: [S, V] -> each row's argmax (its first maximal value): C's vectorized search where it
    applies (cpu_layer_ops.argmax_rows: 0.1 against 1.1 ms at [28, 49152] fp32, one thread), else
    max's indices, 2.7x faster than torch's argmax on the CPU (the same indices, NaN first as well)."""
    found = cpu_layer_ops.argmax_rows(rows)  # None off the CPU, as for other dtypes and layouts
    return found if found is not None else rows.max(dim=-1).indices.tolist()


def is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits first: the argmax of the raw row."""
    return p.greedy and _unprocessed(p)


def sample(logits: torch.Tensor, seqs: Seq[Sequence], allowed: torch.Tensor | None = None
           ) -> list[tuple[int, TokenLogprob | None]]:
    """logits: [S, V] fp32, one row per sequence -> (token id, logprob or None) each.
    allowed: [S, V] bool, the tokens each row's grammar allows (None: no row is constrained)."""
    masked = logits if allowed is None else logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    tokens = _tokens(masked, seqs)
    if not any(s.params.logprobs for s in seqs):
        return [(token, None) for token in tokens]
    with one_thread():  # two small ops a row
        return [(token, top_logprobs(torch.log_softmax(row, dim=-1), token, seq.params.logprobs)
                 if seq.params.logprobs else None) for row, seq, token in zip(logits, seqs, tokens)]


def _tokens(masked: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """masked: [S, V] fp32, each row's grammar mask applied -> the next token of each row: plain
    greedy rows by one max, the rest after their bias and penalties, greedy ones by argmax and
    sampled ones in one `draw_tokens` call."""
    if all(is_plain_greedy(s.params) for s in seqs):
        return argmax_tokens(masked)
    with one_thread():  # small ops, a dozen a processed row: see token_draw.draw_tokens
        rows = _processed_rows(masked, seqs)
        tokens = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            for i, token in zip(greedy, argmax_tokens(_taken(rows, greedy))):
                tokens[i] = token
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            drawn = draw_tokens(_taken(rows, sampled), [seqs[i].params for i in sampled],
                                [seqs[i].generator() for i in sampled])
            for i, token in zip(sampled, drawn):
                tokens[i] = token
        return tokens


def _processed_rows(masked: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """masked [S, V] -> the rows with a logit bias or penalty processed (`processed_logits`), the
    others as they are (`masked` itself when no row has one)."""
    processed = [i for i, s in enumerate(seqs) if not _unprocessed(s.params)]
    if not processed:
        return masked
    rows = masked.clone()
    for i in processed:
        rows[i] = processed_logits(masked[i], seqs[i])
    return rows


def _unprocessed(p: SamplingParams) -> bool:
    """No logit bias or penalty: the row's logits are drawn from as they are."""
    return p.repetition_penalty == 1.0 and not p.logit_bias and p.presence_penalty == 0 and p.frequency_penalty == 0


def _taken(rows: torch.Tensor, which: list[int]) -> torch.Tensor:
    """rows [S, V] -> the listed rows [len(which), V]: `rows` itself when that is all of them (no copy)."""
    return rows if len(which) == rows.shape[0] else rows[which]
