"""OpenAI response JSON from the flow's `OutputChunk`s: `chat.completion` / `text_completion`
objects, and for streams `chat.completion.chunk` / `text_completion` chunks, n choices each with
its `index`, logprobs in each endpoint's own shape, tool calls read from a chat's text
(gateway.http.tools), and a `system_fingerprint` on every object. The requests they answer are
parsed by `gateway.http.openai_schema`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

from gateway.http.openai_schema import ApiRequest
from gateway.http.tool_calls import Delta, ParsedOutput, ToolCallParser, finish_reason_for, message_json
from gateway.output import LogprobText, OutputChunk, TokenTexts, Usage
from pdserve import __version__

MIN_LOGPROB = -9999.0  # what a -inf logprob (a token no one could sample) is sent as: JSON has no -inf


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def total_usage(usages: Sequence[tuple[Usage, bool]]) -> Usage:
    """The usage of a response as OpenAI counts it: every choice's completion tokens, each prompt
    once (the usage of its first choice, which `leads` marks); n choices share a prompt."""
    return Usage(sum(u.prompt_tokens for u, leads in usages if leads),
                 sum(u.completion_tokens for u, _ in usages),
                 sum(u.cached_tokens for u, leads in usages if leads))


def finish_reason_json(reason: str) -> str:
    # The flow's "abort" (ended without a worker's reason) has no OpenAI name; the text did stop.
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def system_fingerprint(deployment: str, model_fingerprint: str) -> str:
    """OpenAI's system_fingerprint: names what answered (the deployment, its weights and config, and
    pdserve's version), so a client sees when the same request may start to answer differently."""
    digest = hashlib.sha256(f"{deployment}\0{model_fingerprint}\0pdserve {__version__}".encode()).hexdigest()
    return "fp_" + digest[:12]


class ChoiceOutput:
    """One choice of a response as it arrives: its text (the prompt's first when echoed), finish
    reason, usage and the logprobs of its tokens in its endpoint's shape."""

    def __init__(self, api: ApiRequest, index: int, texts: TokenTexts | None, echo: str = "") -> None:
        self.kind = api.kind
        self.index = index
        self._texts = texts  # None when no logprobs were asked for
        self._top = api.logprobs or 0
        self.echo = echo
        self.parts: list[str] = [echo] if echo else []
        self.offset = len(echo)  # characters so far: completions' text_offset of the next token
        self.logprobs: list[tuple[LogprobText, int]] = []  # (token, its text_offset)
        self.finish_reason = ""
        self.usage: Usage | None = None
        # An answer read for tool calls: its text goes through the parser, which streams content
        # and tool-call deltas; `parsed` is the whole answer once it has finished.
        self.parser = ToolCallParser() if api.kind == "chat" and api.tools is not None and api.tools.parses else None
        self.deltas: list[Delta] = []  # the parser's deltas of the last chunk added
        self.parsed: ParsedOutput | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, chunk: OutputChunk) -> list[tuple[LogprobText, int]]:
        """Take in one chunk; returns the logprobs of its tokens."""
        self.parts.append(chunk.text)
        new = []
        if self._texts is not None:
            for lp in chunk.logprobs:
                entry = self._texts.add(lp, self._top)
                new.append((entry, self.offset))
                self.offset += len(entry.text)
        self.logprobs.extend(new)
        if self.parser is not None:
            self.deltas = self.parser.feed(chunk.text)
        if chunk.finish_reason:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage
            if self.parser is not None:
                self.parsed = self.parser.finish()
                self.deltas += self.parsed.deltas
                self.finish_reason = finish_reason_for(chunk.finish_reason, self.parsed)
        return new

    def logprobs_json(self, entries: Sequence[tuple[LogprobText, int]] | None = None) -> dict[str, Any] | None:
        """`entries` (default: all so far) as chat's {"content": [...]} or completions' parallel
        arrays; None when no logprobs were asked for."""
        if self._texts is None:
            return None
        entries = self.logprobs if entries is None else entries
        if self.kind == "chat":
            return {"content": [{**_token_json(e), "top_logprobs": [_token_json(t) for t in e.top]}
                                for e, _ in entries], "refusal": None}
        return {"tokens": [e.text for e, _ in entries],
                "token_logprobs": [_logprob(e.logprob) for e, _ in entries],
                # OpenAI's dicts hold the sampled token too: up to logprobs + 1 entries
                "top_logprobs": [{**{t.text: _logprob(t.logprob) for t in e.top}, e.text: _logprob(e.logprob)}
                                 for e, _ in entries],
                "text_offset": [offset for _, offset in entries]}


def _token_json(e: LogprobText) -> dict[str, Any]:
    return {"token": e.text, "logprob": _logprob(e.logprob), "bytes": list(e.bytes)}


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def completion_json(api: ApiRequest, model: str, fingerprint: str, choices: Sequence[ChoiceOutput],
                    usage: Usage) -> dict[str, Any]:
    """The whole (non-streamed) chat.completion or text_completion object."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        reason = finish_reason_json(c.finish_reason)
        if api.kind == "chat":
            message = message_json(c.parsed) if c.parsed is not None else {"role": "assistant", "content": c.text}
            out.append({"index": c.index, "message": message, "logprobs": c.logprobs_json(), "finish_reason": reason})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": c.logprobs_json(), "finish_reason": reason})
    return {"id": api.response_id, "object": "chat.completion" if api.kind == "chat" else "text_completion",
            "created": api.created, "model": model, "system_fingerprint": fingerprint, "choices": out,
            "usage": usage_json(usage)}


def chunk_json(api: ApiRequest, model: str, fingerprint: str, *, index: int = 0, text: str | None = None,
               role: bool = False, finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk with one choice: the role (chat), a text delta (with its tokens'
    logprobs when asked), a chat `delta` as given (tool calls: gateway.http.tool_calls.delta_json), or
    the finish reason."""
    reason = finish_reason_json(finish_reason) if finish_reason else None
    if api.kind == "chat":
        delta_: dict[str, Any] = {}
        if role:
            delta_["role"] = "assistant"
            delta_["content"] = ""
        if text is not None:
            delta_["content"] = text
        delta_.update(delta or {})
        choice: dict[str, Any] = {"index": index, "delta": delta_, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    return _chunk_envelope(api, model, fingerprint, [choice], None)


def usage_chunk_json(api: ApiRequest, model: str, fingerprint: str, usage: Usage) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, the usage."""
    return _chunk_envelope(api, model, fingerprint, [], usage_json(usage))


def _chunk_envelope(api: ApiRequest, model: str, fingerprint: str, choices: Sequence[dict[str, Any]],
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    obj = "chat.completion.chunk" if api.kind == "chat" else "text_completion"
    out: dict[str, Any] = {"id": api.response_id, "object": obj, "created": api.created, "model": model,
                           "system_fingerprint": fingerprint, "choices": list(choices)}
    if api.include_usage:
        out["usage"] = usage  # null on every chunk but the last, as OpenAI does
    return out
