"""How long the gateway waits for workers before it gives up on them (docs/reliability.md).

Two bounds, one frozen dataclass, part of the gateway's config (`gateway.config.GatewayConfig`):

- `decode_stall_s` (--decode-stall-timeout-s): a decode stream that delivers no message for this
  long is cancelled and resumed on another decode worker, exactly as if its worker had died. It
  is the backstop for a hang the health checks do not see (a worker whose health service answers
  while its engine is stuck); a hung process fails its health checks first and its streams move
  then (gateway.workers). The wait it bounds includes a local prefill's compute and time queued
  behind a full batch, so it must exceed the longest of those: the default is conservative.
- `http_request_s` (--http-timeout-s): the total time an HTTP request may take (the gRPC API has
  the client's own deadline instead). It becomes the flow's deadline, so every downstream call
  gets the time left as its timeout, and a request that runs out ends with 504 (or, once the
  stream has started, an SSE error event of type "timeout").

0 turns either off.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.config_flags import add_flags, build, setting


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long the gateway waits for workers (module docstring); each field one flag."""

    decode_stall_s: float = setting(30.0, "a decode stream that delivers nothing for S seconds is resumed on "
                                    "another decode worker; must exceed the longest local prefill or queue wait "
                                    "(0 = off)", flag="--decode-stall-timeout-s", metavar="S")
    http_request_s: float = setting(600.0, "total time an HTTP request may take before it ends with 504 "
                                    "(0 = no bound)", flag="--http-timeout-s", metavar="S")

    def __post_init__(self) -> None:
        for flag, value in (("--decode-stall-timeout-s", self.decode_stall_s),
                            ("--http-timeout-s", self.http_request_s)):
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{flag} must be >= 0 seconds (0 = off), got {value:g}")

    @property
    def stall_s(self) -> float | None:
        """The decode stall bound, None when off."""
        return self.decode_stall_s or None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's (and `pdserve up`'s) flags, defaults from Deadlines."""
    add_flags(parser, Deadlines)


def from_args(args: argparse.Namespace) -> Deadlines:
    """Deadlines of parsed flags (defaults for flags the parser lacks); ValueError naming a bad flag."""
    return build(Deadlines, args, {})


def gateway_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags as a gateway command line (`pdserve up` forwards its own)."""
    d = from_args(args)
    return ("--decode-stall-timeout-s", str(d.decode_stall_s), "--http-timeout-s", str(d.http_request_s))
