"""Request ids: the gateway's own for every request; a client's, scoped by its API key, for echo.

A client-chosen request_id used to name the request to the workers, whose state is keyed by it
(prefill's single flight, the engine's running table, the kvstore lease): two concurrent calls
with one id, even from two API keys, joined one prefill (one tenant received the other's first
token) and the second decode hung on "already running". Now:

  - every request gets a gateway-unique id (`new_id`) that names it downstream, in the flow's
    logs and in the experiment tables;
  - the client's id (`GenerationRequest.client_request_id`) is echoed in responses and spans;
    while a request of a tenant (its API key; without keys all clients are one tenant) runs with
    an id, another with the same id is refused at once, ALREADY_EXISTS (HTTP 409); two keys with
    the same id never meet;
  - feedback joins by the id the client saw: `resolve` maps a tenant's recent client ids (the
    last `max_recent`) to the gateway's.

A tenant is the SHA-256 of the bearer token the call carries (the API key interceptor and
middleware have checked it already): the gRPC and the HTTP API see one key as one tenant.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc

from pdserve.grpc_server import ServiceError

if TYPE_CHECKING:
    from gateway.flow import GenerationRequest

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (tenant, client request id)


def new_id() -> str:
    """A gateway-unique request id."""
    return uuid.uuid4().hex


def tenant_of(authorization: str | None) -> str:
    """The tenant of a call's `authorization` value ("Bearer <key>"): "" without a key."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return hashlib.sha256(token.strip().encode()).hexdigest()


class RequestIds:
    """Client ids in flight per tenant, and the recent ones' gateway ids (for feedback)."""

    def __init__(self, max_recent: int = 10_000) -> None:
        self.max_recent = max_recent
        self._inflight: set[Key] = set()
        self._recent: OrderedDict[Key, str] = OrderedDict()  # least recent first

    @contextmanager
    def claim(self, tenant: str, request: GenerationRequest) -> Iterator[None]:
        """Hold the request's client id for the block; ALREADY_EXISTS when the tenant already runs
        a request with it. A request without a client id holds nothing."""
        client_id = request.client_request_id
        if not client_id:
            yield
            return
        key = (tenant, client_id)
        if key in self._inflight:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request_id {client_id!r} is already in flight for this API key; wait for "
                               "it to finish, or send a new id (or none: the gateway then makes one)")
        self._inflight.add(key)
        self._remember(key, request.request_id)
        log.debug("request_id %r runs as %s", client_id, request.request_id)  # joins client and worker logs
        try:
            yield
        finally:
            self._inflight.discard(key)

    def resolve(self, tenant: str, request_id: str) -> str:
        """The gateway's id of the tenant's recent request `request_id` (itself when the gateway
        made it: those are the ids clients see when they send none)."""
        return self._recent.get((tenant, request_id), request_id)

    def _remember(self, key: Key, gateway_id: str) -> None:
        self._recent[key] = gateway_id
        self._recent.move_to_end(key)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)


# The process's: the gRPC and the HTTP API of one gateway share it (an id is one id for both).
IDS = RequestIds()
