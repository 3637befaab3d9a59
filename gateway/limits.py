"""Bounded admission: at most `max_inflight` requests run through the gateway at once.

Past the limit a request is refused at once with RESOURCE_EXHAUSTED (the client backs off or
tries another gateway) instead of queueing without bound in the gateway's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.grpc_server import ServiceError


class InflightLimit:
    """Counts admitted requests; `admit()` refuses the one past the limit."""

    def __init__(self, max_inflight: int) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self.max_inflight = max_inflight
        self.inflight = 0

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one slot for the duration of the block; ServiceError RESOURCE_EXHAUSTED when full."""
        if self.inflight >= self.max_inflight:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"gateway is at its limit of {self.max_inflight} requests in flight "
                               "(--max-inflight); retry later")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
