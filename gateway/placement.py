"""Where a request's prompt is prefilled: on a prefill worker (remote, KV through the store) or on
the decode worker itself (local). The gateway asks a `PrefillPlacement` once per request, after
the kvstore lookup and the choice of decode worker, before any prefill starts.

`AlwaysRemote` is the classic disaggregated path and the default. Conditional policies live in
`gateway.disagg`; the flow only depends on this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Placement = Literal["remote", "local"]


@dataclass(frozen=True, slots=True)
class PlacementInputs:
    """What the gateway knows about a request and the cluster when it places the prefill."""

    prompt_tokens: int
    cached_tokens: int  # leading prompt tokens whose KV the kvstore holds (a hint, block-aligned)
    prefill_inflight: int  # requests in flight on the healthy prefill workers, all together
    prefill_healthy: int  # healthy prefill workers (0: remote prefill is impossible)
    decode_running: int  # sequences running on the chosen decode worker (from its last Stats)
    decode_inflight: int  # requests the gateway has in flight on the chosen decode worker

    @property
    def uncached_tokens(self) -> int:
        """Prompt tokens whose KV must be computed."""
        return max(self.prompt_tokens - self.cached_tokens, 0)


class PrefillPlacement(Protocol):
    """Decides remote or local prefill for one request."""

    def place(self, inputs: PlacementInputs) -> Placement: ...


class AlwaysRemote:
    """Every prompt goes to a prefill worker (falls back to local only when none is healthy)."""

    def place(self, inputs: PlacementInputs) -> Placement:
        return "remote" if inputs.prefill_healthy > 0 else "local"
