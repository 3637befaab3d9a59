"""A Sequence: one request's tokens, its block table and its progress through the engine."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.runtime.grammar import GrammarMatcher
    from pdserve.runtime.speculative import NgramIndex


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the top alternatives


@dataclass(frozen=True, slots=True)
class ExternalKV:
    """KV computed elsewhere (a prefill worker, the kvstore, another worker's prefix) that a
    sequence may use instead of computing it. It travels on the sequence; the scheduler brings
    it into the paged cache when it admits the sequence (`BlockManager.allocate`), so a waiting
    sequence holds no blocks. Blocks the cache holds by then are shared instead of copied."""

    blocks: Mapping[bytes, torch.Tensor]  # hash -> block [layers, 2, rows, KVH, D]
    tail: bytes | None = None  # hash of the prompt's partial last block, when the whole prompt came


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # owned; refs counted by BlockManager
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks, in order
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str = ""
    hold_blocks: bool = False  # prefill role: keep the KV after finishing until exported
    resumed_tokens: int = 0  # trailing prompt tokens this request generated before a resume
    external: ExternalKV | None = None  # KV from elsewhere, until admission takes it in
    # Structured output: where the generated tokens are in the grammar (advanced over every one,
    # those generated before a resume and a prefill's first token included); None: unconstrained.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: the n-gram index of its tokens the draft proposer keeps (built lazily).
    draft_index: NgramIndex | None = None

    def generator(self) -> torch.Generator | None:
        """RNG of the next token when seeded: a function of (seed, position) only, so a request
        sampled partly on a prefill worker and partly on a decode worker draws what it would
        draw in one process; a resumed stream counts the tokens it generated before."""
        if self.params.seed is None:
            return None
        import torch  # here, not at the top: the gateway imports this module's dataclasses without torch

        position = self.resumed_tokens + len(self.output_ids)
        return torch.Generator().manual_seed((self.params.seed * 1_000_003 + position) % (1 << 63))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def generated_ids(self) -> list[int]:
        """Every token this request generated: a resumed stream's tail of the prompt, then the
        outputs (a prefill's first token among them). What presence/frequency penalties count."""
        start = len(self.prompt_ids) - self.resumed_tokens
        return self.prompt_ids[start:] + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
