"""Bounded admission: at most `max_inflight` requests run through the gateway at once.

Past the limit a request is refused at once with RESOURCE_EXHAUSTED (the client backs off or
tries another gateway) instead of queueing without bound in the gateway's memory. The refusal
carries a retry hint of `RETRY_AFTER_S`: gRPC trailing metadata "retry-after" (whole seconds) and
"grpc-retry-pushback-ms" (what gRPC's own retry policy honours), HTTP's Retry-After header
(`pdserve.grpc_server.abort_on`, `gateway.http.errors`). This is the
hard cap; `gateway.admission.SloAdmission` adds the SLO-aware refusal on top of it.

`admit(prompt_tokens)` yields an `Admitted` ticket; the flow calls `ticket.first_token()` when the
request's first token is out, which an admission controller learns from (a no-op here).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.grpc_server import ServiceError

# When to retry after an in-flight refusal. A slot frees when some running stream ends, which the
# gateway cannot predict; one second is the usual back-off base (HTTP 429's default here too).
RETRY_AFTER_S = 1.0


class Admitted:
    """The ticket of one admitted request."""

    def first_token(self) -> None:
        """The request's first token was emitted (only the first call counts)."""


class InflightLimit:
    """Counts admitted requests; `admit()` refuses the one past the limit."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.inflight = 0

    @contextmanager
    def admit(self, prompt_tokens: int = 0) -> Iterator[Admitted]:
        """Hold one slot for the duration of the block; ServiceError RESOURCE_EXHAUSTED when full."""
        with self.hold():
            yield Admitted()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The in-flight slot alone (what `admit` and its subclasses hold)."""
        if self.inflight >= self.max_inflight:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gateway is at its limit of {self.max_inflight} requests in flight "
                               "(--max-inflight); retry later", retry_after_s=RETRY_AFTER_S)
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
