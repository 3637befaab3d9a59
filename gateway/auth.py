"""API keys at the gateway: who may call it, and each key's share (`gateway.key_limits`).

With `--api-keys-file` (or PDSERVE_API_KEYS_FILE; `gateway.config.GatewayConfig.api_keys_file`, read
into a `KeyRing` by `gateway.server.serve_catalog`) every gRPC call and every HTTP request but the
open ones must carry `authorization: Bearer <key>` (gRPC metadata or the HTTP header). The file
holds one key per line, optionally named and limited; `#` starts a comment:

    sk-team-a-3f9c...  name=team-a rate=5/s burst=10 concurrency=4
    sk-batch-77d1...   name=batch  rate=600/m
    sk-admin-0b2e...

Keys live in memory only as SHA-256 digests and are compared in constant time (every digest is
compared, whatever matches); logs and errors name a key by its `name=` (default: "key-" and 8 hex
digits of its digest), never by the key. Missing or unknown keys get UNAUTHENTICATED (HTTP 401,
OpenAI's `invalid_api_key`); a key over its limits gets RESOURCE_EXHAUSTED (HTTP 429 with
Retry-After). Open without a key: gRPC health and reflection, HTTP `/health` and the chat page
`/` (static; it sends the key the user types in its API key field).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web

from gateway.http.errors import ApiError, Handler
from gateway.key_limits import Clock, KeyLimiter, KeyLimitExceeded, KeyLimits
from pdserve.interceptors import is_open_method, metadata_value, refusing, wrapped

OPEN_HTTP_PATHS = frozenset({"/health", "/"})


class AuthError(Exception):
    """The request carries no API key, or one the gateway does not know."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One configured key: its name (for logs), the SHA-256 digest of the key, its limits."""

    name: str
    digest: bytes
    limits: KeyLimits


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key_line(line: str) -> ApiKey | None:
    """The key of one keys-file line, None for a blank or comment line; ValueError when malformed."""
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    key, options = fields[0], fields[1:]
    if "=" in key:
        raise ValueError("a line must start with the key, then name=/rate=/burst=/concurrency= options")
    names = [o.partition("=")[2] for o in options if o.startswith("name=")]
    limits = KeyLimits.parse([o for o in options if not o.startswith("name=")])
    key_digest = digest(key)
    return ApiKey(names[-1] if names else f"key-{key_digest.hex()[:8]}", key_digest, limits)


def parse_keys(text: str, source: str = "keys file") -> list[ApiKey]:
    """Every key of a keys file's text; ValueError naming the line (never echoing a key)."""
    keys: list[ApiKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            key = parse_key_line(line)
        except ValueError as err:
            raise ValueError(f"{source} line {number}: {err}") from None
        if key is None:
            continue
        if any(k.digest == key.digest or k.name == key.name for k in keys):
            raise ValueError(f"{source} line {number}: key or name {key.name!r} appears twice")
        keys.append(key)
    if not keys:
        raise ValueError(f"{source} holds no API key; remove the option to run without keys")
    return keys


class KeyRing:
    """The configured keys and a limiter per key, shared by the gRPC and the HTTP API."""

    def __init__(self, keys: Sequence[ApiKey], clock: Clock = time.monotonic) -> None:
        self._keys = list(keys)
        self._limiters = {k.name: KeyLimiter(k.name, k.limits, clock) for k in keys}

    @classmethod
    def from_file(cls, path: str | Path) -> KeyRing:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"cannot read the API keys file {path}: {err.strerror or err}") from None
        return cls(parse_keys(text, str(path)))

    def __len__(self) -> int:
        return len(self._keys)

    def authenticate(self, authorization: str | None) -> KeyLimiter:
        """The limiter of the key in an `authorization` value ("Bearer <key>"); AuthError otherwise."""
        presented = bearer_token(authorization)
        candidate = digest(presented)
        found: ApiKey | None = None
        for key in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(key.digest, candidate):
                found = key
        if found is None:
            raise AuthError("the API key is not valid; check the key sent as 'authorization: Bearer <key>'")
        return self._limiters[found.name]


def bearer_token(authorization: str | None) -> str:
    """The key of "Bearer <key>"; AuthError when there is none."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("this gateway requires an API key: send 'authorization: Bearer <key>' "
                        "(gRPC metadata or HTTP header)")
    return token.strip()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """gRPC edge: UNAUTHENTICATED without a valid key, RESOURCE_EXHAUSTED over the key's limits."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        try:
            limiter = self.ring.authenticate(
                metadata_value(handler_call_details.invocation_metadata, "authorization"))
        except AuthError as err:
            return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, str(err))
        return wrapped(handler, lambda context: _grpc_admission(limiter, context))


@asynccontextmanager
async def _grpc_admission(limiter: KeyLimiter, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    try:
        limiter.acquire()
    except KeyLimitExceeded as err:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err),
                            trailing_metadata=(("retry-after", _retry_after(err)),))
    try:
        yield
    finally:
        limiter.release()


def http_middleware(ring: KeyRing):  # -> an aiohttp middleware
    """HTTP edge: 401 without a valid key, 429 (Retry-After) over the key's limits; OpenAI error JSON."""
    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        try:
            limiter = ring.authenticate(request.headers.get("Authorization"))
        except AuthError as err:
            raise ApiError(401, str(err), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}) from None
        try:
            limiter.acquire()
        except KeyLimitExceeded as err:
            raise ApiError(429, str(err), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": _retry_after(err)}) from None
        try:
            return await handler(request)
        finally:
            limiter.release()
    return require_api_key


def _retry_after(err: KeyLimitExceeded) -> str:
    return str(max(1, math.ceil(err.retry_after_s)))


def grpc_interceptors(ring: KeyRing | None) -> list[grpc.aio.ServerInterceptor]:
    """The gateway's API key interceptor over `ring` ([] when keys are off: None)."""
    return [ApiKeyInterceptor(ring)] if ring is not None else []


def http_middlewares(ring: KeyRing | None) -> list:
    """The HTTP API's API key middleware over `ring` ([] when keys are off: None)."""
    return [http_middleware(ring)] if ring is not None else []
