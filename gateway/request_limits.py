"""The gateway's request limits: how big a request a client may send, checked before any work.

The context window bounds prompt + max_tokens already (`prompts.check_fits`); these bound the
rest of what a single request can make the gateway and the workers do, whatever the model: prompt
tokens, generated tokens, stop strings (matched against every new piece of text), chat messages
(each rendered by the template), and the bytes of a request (gRPC's receive limit on the public
server, aiohttp's `client_max_size` on the HTTP API; they also bound the tokenizer's work).
A request over a limit fails INVALID_ARGUMENT (HTTP 400) with the limit and its flag named; a
gRPC message over --max-request-bytes fails RESOURCE_EXHAUSTED (gRPC's own check), an HTTP body
over it 413.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.flow import GenerationRequest
    from pdserve.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of the gateway; every field is a positive bound (see `add_arguments`)."""

    max_prompt_tokens: int = 32768  # tokens of the prompt or rendered chat
    max_tokens: int = 4096  # a request's max_tokens (HTTP's default max_tokens is capped to it)
    max_stop_strings: int = 4  # stop strings per request (OpenAI's limit)
    max_stop_chars: int = 256  # characters of each stop string
    max_messages: int = 1024  # messages of a chat
    max_request_bytes: int = 8 << 20  # one gRPC request message / one HTTP request body

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"--{_flag(f.name)} must be >= 1, got {getattr(self, f.name)}")

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


def _flag(field_name: str) -> str:
    return {"max_tokens": "max-tokens-limit"}.get(field_name, field_name.replace("_", "-"))


_HELP = {
    "max_prompt_tokens": "most tokens a prompt (or rendered chat) may have",
    "max_tokens": "largest max_tokens a request may ask for; also caps HTTP's default max_tokens",
    "max_stop_strings": "most stop strings per request",
    "max_stop_chars": "most characters per stop string",
    "max_messages": "most messages per chat request",
    "max_request_bytes": "largest gRPC request message and HTTP request body (bigger: "
                         "RESOURCE_EXHAUSTED / HTTP 413)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per RequestLimits field, its default the field's."""
    defaults = RequestLimits()
    for f in fields(RequestLimits):
        parser.add_argument(f"--{_flag(f.name)}", dest=f"limit_{f.name}", type=int, metavar="N",
                            default=getattr(defaults, f.name),
                            help=f"{_HELP[f.name]} (default {getattr(defaults, f.name)})")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The RequestLimits of parsed flags (defaults for flags the parser does not have)."""
    defaults = RequestLimits()
    return RequestLimits(**{f.name: getattr(args, f"limit_{f.name}", getattr(defaults, f.name))
                            for f in fields(RequestLimits)})


_current = RequestLimits()


def current() -> RequestLimits:
    """The gateway process's limits: the defaults until `use` (the gateway's flags at start) sets them."""
    return _current


def use(limits: RequestLimits | None) -> None:
    """Make `limits` the process's limits (None: the defaults); read by the servers started after."""
    global _current
    _current = limits or RequestLimits()
