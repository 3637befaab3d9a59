"""The gateway's request limits: how big a request a client may send, checked before any work.

The context window bounds prompt + max_tokens already (`prompts.check_fits`); these bound the
rest of what a single request can make the gateway and the workers do, whatever the model: prompt
tokens, generated tokens, stop strings (matched against every new piece of text), chat messages
(each rendered by the template), and the bytes of a request (gRPC's receive limit on the public
server, aiohttp's `client_max_size` on the HTTP API; they also bound the tokenizer's work).
A request over a limit fails INVALID_ARGUMENT (HTTP 400) with the limit and its flag named; a
gRPC message over --max-request-bytes fails RESOURCE_EXHAUSTED (gRPC's own check), an HTTP body
over it 413.

Checked before any work, in this order: the ids a client chooses (request_id, session_id; the
gateway keeps them in memory and in spans), the prompt's length in characters (tokenizing is the
gateway's own work, about 3 us a character: the limit is min(--max-prompt-tokens, the context
window) x --max-chars-per-token, generous for any real text), then stop strings and messages;
prompt tokens after tokenizing. The HTTP API also bounds how long a client may take to send a
request's head (--http-header-timeout-s: a slow-header connection is closed) and its body
(--http-body-timeout-s: 408).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pdserve.config_flags import add_flags, build, flag_of, setting

if TYPE_CHECKING:
    from gateway.flow import GenerationRequest
    from pdserve.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of the gateway; every field is a positive bound and one flag (--help:
    the field's text). Part of `gateway.config.GatewayConfig`."""

    max_prompt_tokens: int = setting(32768, "most tokens a prompt (or rendered chat) may have", metavar="N")
    max_tokens: int = setting(4096, "largest max_tokens a request may ask for; also caps HTTP's default max_tokens",
                              flag="--max-tokens-limit", metavar="N")
    max_stop_strings: int = setting(4, "most stop strings per request (OpenAI's limit)", metavar="N")
    max_stop_chars: int = setting(256, "most characters per stop string", metavar="N")
    max_messages: int = setting(1024, "most messages per chat request", metavar="N")
    max_request_bytes: int = setting(8 << 20, "largest gRPC request message and HTTP request body (bigger: "
                                     "RESOURCE_EXHAUSTED / HTTP 413)", metavar="N")
    max_chars_per_token: int = setting(16, "prompt characters allowed per token of the prompt limit, checked "
                                       "before tokenizing (limit: min(--max-prompt-tokens, context window) x this)",
                                       metavar="N")
    max_id_chars: int = setting(256, "most characters of a client's request_id / session_id (HTTP: X-Request-Id "
                                "/ user)", metavar="N")
    http_header_timeout_s: int = setting(10, "seconds an HTTP connection may take to send a request's head (or "
                                         "stay idle between requests) before it is closed", metavar="N")
    http_body_timeout_s: int = setting(60, "seconds an HTTP request may take to send its body (then 408)",
                                       metavar="N")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{flag_of(RequestLimits, f.name)} must be >= 1, got {getattr(self, f.name)}")

    def check_ids(self, request: GenerationRequest) -> None:
        """ValueError naming the limit when a client-chosen id is too long (checked first of all:
        ids are kept in memory, in the session table and in spans)."""
        for field_name, value in (("request_id", request.client_request_id), ("session_id", request.session_id)):
            if len(value) > self.max_id_chars:
                alias = " (HTTP: X-Request-Id)" if field_name == "request_id" else " (HTTP: user)"
                raise ValueError(f"{field_name}{alias} has {len(value)} characters, over this gateway's limit of "
                                 f"{self.max_id_chars} (--max-id-chars); use a shorter id")

    def check_chars(self, prompt_chars: int, context_window: int) -> None:
        """ValueError when a prompt of `prompt_chars` characters cannot fit in the token limit at
        --max-chars-per-token: refused before the tokenizer spends time on it."""
        tokens = min(self.max_prompt_tokens, context_window)
        limit = tokens * self.max_chars_per_token
        if prompt_chars > limit:
            raise ValueError(f"the prompt has {prompt_chars} characters, over this gateway's limit of {limit} "
                             f"({tokens} tokens, the smaller of --max-prompt-tokens and the model's context "
                             f"window, x {self.max_chars_per_token} characters per token, "
                             "--max-chars-per-token); shorten it")

    def check_request(self, request: GenerationRequest) -> None:
        """ValueError naming the limit when the request's stop strings or chat messages exceed one
        (checked before tokenizing: rendering many messages is work)."""
        stop = request.sampling.stop
        if len(stop) > self.max_stop_strings:
            raise ValueError(f"{len(stop)} stop strings exceed this gateway's limit of "
                             f"{self.max_stop_strings} (--max-stop-strings); send fewer")
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_chars:
            raise ValueError(f"a stop string of {longest} characters exceeds this gateway's limit of "
                             f"{self.max_stop_chars} (--max-stop-chars); shorten it")
        if request.messages is not None and len(request.messages) > self.max_messages:
            raise ValueError(f"{len(request.messages)} chat messages exceed this gateway's limit of "
                             f"{self.max_messages} (--max-messages); drop or merge older messages")

    def check_tokens(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """ValueError when the tokenized prompt or max_tokens exceeds its limit (checked after the
        context window, whose message says more when both are exceeded)."""
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, over this gateway's limit of "
                             f"{self.max_prompt_tokens} (--max-prompt-tokens); shorten it")
        if sampling.max_tokens > self.max_tokens:
            raise ValueError(f"max_tokens {sampling.max_tokens} exceeds this gateway's limit of "
                             f"{self.max_tokens} (--max-tokens-limit); ask for at most {self.max_tokens}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RequestLimits field, its default the field's."""
    add_flags(parser, RequestLimits)


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The RequestLimits of parsed flags (defaults for flags the parser does not have)."""
    return build(RequestLimits, args, {})
