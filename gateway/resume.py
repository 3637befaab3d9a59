"""Resuming a stream on another decode worker: what the gateway remembers to do it, and how.

A decode worker that dies mid-stream loses its sequence, not the request. The gateway has
delivered every token in `StreamProgress.generated` to the client, in order (the first one from
prefill or from a local prefill, the rest from decode chunks). A Decode with local prefill whose
prompt is the original prompt followed by all of `generated` makes another worker find (paged
cache, kvstore: prefill stored the prompt, the dead worker wrote each generated block back as it
filled) or compute the KV of every token the client has seen, and sample exactly the next one,
so every token reaches the client once and greedy output equals an undisturbed run.

max_tokens shrinks by what was generated (prompt + max_tokens stays the same, so the request
still fits the context window); `resumed_tokens` tells the worker how many prompt tokens were
generated, so seeded sampling stays on the same random stream (the seed is combined with the
token's position in the output, see Sequence.generator). Stop strings need nothing: the
gateway's OutputAssembler holds the detokenizer state and simply receives the new worker's
tokens. Penalties see the same tokens (prompt + output either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.runtime.sampling_params import SamplingParams

MAX_RESUMES = 2  # decode workers a request may lose mid-stream before it fails (UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The Decode (local prefill) that continues a stream where the client is."""

    prompt_ids: list[int]  # the original prompt + every token delivered
    sampling: SamplingParams  # max_tokens less the tokens delivered
    resumed_tokens: int  # tokens delivered: the tail of prompt_ids that was generated


@dataclass(slots=True)
class StreamProgress:
    """One request's stream as the client has seen it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    generated: list[int] = field(default_factory=list)  # tokens delivered, in order
    worker: str = ""  # the decode worker streaming now
    lost: list[str] = field(default_factory=list)  # decode workers lost mid-stream, in order

    def resume_point(self) -> ResumePoint | None:
        """Where a new worker must start; None when nothing is left to generate (the stream had
        all its tokens and lacked only the finish reason: it ends with "length")."""
        left = self.sampling.max_tokens - len(self.generated)
        if left < 1:
            return None
        return ResumePoint(self.prompt_ids + self.generated, replace(self.sampling, max_tokens=left),
                           len(self.generated))

    def may_resume(self) -> bool:
        return len(self.lost) <= MAX_RESUMES
