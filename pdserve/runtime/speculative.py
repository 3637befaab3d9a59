"""Speculative decoding by prompt n-gram lookup (no draft model), as vLLM's `ngram` method.

For a decoding sequence, the last n tokens (n from `max_ngram` down to `min_ngram`) are looked up
earlier in its prompt + output; the k tokens that followed their latest earlier occurrence are the
draft. The scheduler runs the sequence's last token plus the draft as one chunk over its cached
context (the chunked-prefill path), so one forward pass gives logits at all 1 + k positions; the
engine then draws the token of each position in order, exactly as plain decoding would draw it
(`Engine._verify`), and keeps each draft token while it equals the draw.

That is rejection sampling for a deterministic (delta) draft: the draw y ~ p equals the draft x
with probability p(x) (accept), and given y != x it is distributed as p with x removed,
renormalised (the residual), so the output distribution is plain sampling's, whatever p is
(temperature, top-k/p, min-p, penalties: each row sees the accepted tokens before it). Drawing y
from the position's seeded generator, as plain decoding does, makes seeded and greedy output
equal to non-speculative output token for token, not only in distribution.

Rejected drafts leave nothing behind: draft tokens never enter the sequence's tokens (so no block
hash covers them), its computed length grows only by the accepted ones, and blocks taken for the
draft beyond what the sequence now needs are released (`BlockManager.trim`).

Structured-output requests do not speculate: the grammar mask of each position after the first
depends on the draft tokens before it, so the matcher would have to be advanced over unverified
tokens and rolled back, per position, inside the one llguidance call the engine overlaps with the
forward pass; the gain on grammar-bound text does not pay for that complexity yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.runtime.config import ConfigError

if TYPE_CHECKING:
    from pdserve.runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Prompt n-gram speculation; `num_tokens` = 0 turns it off."""

    num_tokens: int = 0  # k: draft tokens proposed per step and sequence
    min_ngram: int = 1  # shortest suffix looked up
    max_ngram: int = 3  # longest suffix looked up (tried first)
    # Speculate only while at most this many sequences run or wait: verifying drafts costs compute,
    # which is free while a step is bound by reading the weights (few streams), not at many.
    max_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise ConfigError(f"speculative draft tokens must be >= 0 (0 turns it off), got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"speculative n-gram sizes need 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")
        if self.max_batch_size < 1:
            raise ConfigError(f"speculative max batch size must be >= 1, got {self.max_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


class NgramIndex:
    """Where each n-gram (min..max tokens) of a growing token list last ended, so a lookup costs
    O(max_ngram) instead of a scan of the whole context. Tokens are only ever appended."""

    __slots__ = ("min_n", "max_n", "_last_end", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # by n
        self._indexed = 0  # n-grams ending at every end <= this are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        end = len(tokens)
        self._extend(tokens, end - 1)  # earlier occurrences: ends before the suffix's own
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            e = self._last_end[n].get(tuple(tokens[end - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []

    def _extend(self, tokens: list[int], upto: int) -> None:
        for e in range(self._indexed + 1, upto + 1):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self._last_end[n][tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, upto)


class NgramProposer:
    """The scheduler's source of drafts."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def allows(self, num_seqs: int) -> bool:
        return num_seqs <= self.config.max_batch_size

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """At most min(k, limit) draft tokens to follow `seq`'s last token; () when it has none."""
        limit = min(limit, self.config.num_tokens)
        if limit <= 0 or seq.grammar is not None or seq.hold_blocks:
            return ()
        if seq.draft_index is None:
            seq.draft_index = NgramIndex(self.config.min_ngram, self.config.max_ngram)
        return tuple(seq.draft_index.propose(seq.token_ids, limit))
