"""What the client receives: token chunks from the workers turned into text chunks.

`OutputAssembler` owns the request's incremental detokenizer (stop strings included) and its
token counts; each `add` takes the tokens of one worker answer and returns the `OutputChunk` to
stream. The chunk that completes a stop string, or carries the worker's finish reason, is the
last one: it has `finish_reason` set and the request's `Usage`.

`TokenTexts` gives the text of each sampled token and of its alternatives, for APIs that show
logprobs by token text (OpenAI's).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.runtime.detokenizer import REPLACEMENT, IncrementalDetokenizer
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


@dataclass(frozen=True, slots=True)
class LogprobText:
    """A token as logprobs show it: its text, its bytes and its logprob; for a sampled token also
    its top alternatives (each a LogprobText without alternatives), most likely first."""

    text: str
    bytes: bytes
    logprob: float
    top: tuple[LogprobText, ...] = ()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens
_CONTEXT = 4  # tokens before a token decoded with it (sentencepiece's leading space needs one)


class TokenTexts:
    """The text of one request's tokens for its logprobs, each decoded after the few tokens before
    it (a token's text depends on its left neighbour: sentencepiece drops a leading space at the
    start of a text). A token that holds part of a UTF-8 character shows as U+FFFD, with its own
    byte when the vocabulary names it (`<0xE2>`)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._context: deque[int] = deque(prompt_ids[-_CONTEXT:], maxlen=_CONTEXT)

    def add(self, lp: TokenLogprob, top: int) -> LogprobText:
        """The sampled token of `lp` with its first `top` alternatives; it then joins the context."""
        before = self._tok.decode(list(self._context))
        alternatives = tuple(self._text(before, t, v) for t, v in lp.top[:top])
        out = self._text(before, lp.token_id, lp.logprob, alternatives)
        self._context.append(lp.token_id)
        return out

    def _text(self, before: str, token_id: int, logprob: float, top: tuple[LogprobText, ...] = ()) -> LogprobText:
        full = self._tok.decode([*self._context, token_id])
        text = full[len(before):] if full.startswith(before) else self._tok.decode([token_id])
        raw = text.encode()
        if REPLACEMENT in text:
            piece = getattr(self._tok, "id_to_piece", None)
            match = _BYTE_PIECE.fullmatch(piece(token_id)) if piece is not None else None
            raw = bytes([int(match[1], 16)]) if match else raw
        return LogprobText(text, raw, logprob, top)
