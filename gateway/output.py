"""What the client receives: token chunks from the workers turned into text chunks.

`OutputAssembler` owns the request's incremental detokenizer (stop strings included) and its
token counts; each `add` takes the tokens of one worker answer and returns the `OutputChunk` to
stream. The chunk that completes a stop string, or carries the worker's finish reason, is the
last one: it has `finish_reason` set and the request's `Usage`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.runtime.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from a cache instead of being computed


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One streamed piece of a completion."""

    text: str  # new text of this chunk (may be "" while a character or stop string is pending)
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str = ""  # "" while running, then "stop" | "length" | "abort"
    usage: Usage | None = None  # set on the last chunk only


class OutputAssembler:
    """Turns token chunks into text chunks for one request."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams,
                 prompt_tokens: int, cached_tokens: int) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, sampling.stop)
        self._want_logprobs = sampling.logprobs > 0
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens
        self.completion_tokens = 0
        self.finished = False

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] = (),
            finish_reason: str = "") -> OutputChunk:
        """The chunk for these tokens; last (finished) when a stop string appears or `finish_reason` is set."""
        self.completion_tokens += len(token_ids)
        text = self._detok.add(token_ids)
        if self._detok.stopped:
            finish_reason = "stop"  # a stop string: the text ends before it, whatever the worker says
        elif finish_reason:
            text += self._detok.finish()
        return self._chunk(text, token_ids, logprobs, finish_reason)

    def abort(self) -> OutputChunk:
        """A last chunk without tokens, for a request that ended without a worker's finish reason."""
        return self._chunk(self._detok.finish(), (), (), "abort")

    def _chunk(self, text: str, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
               finish_reason: str) -> OutputChunk:
        usage = None
        if finish_reason:
            self.finished = True
            usage = Usage(self._prompt_tokens, self.completion_tokens, self._cached_tokens)
        return OutputChunk(text, tuple(token_ids), tuple(logprobs) if self._want_logprobs else (),
                           finish_reason, usage)
