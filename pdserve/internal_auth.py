"""The internal credential: a shared secret the internal services demand of every caller.

TLS (`pdserve.tls`) keeps the wire private; this keeps strangers off the internal ports even on
a network where TLS is not used or client certificates are not required. When
PDSERVE_INTERNAL_TOKEN (or PDSERVE_INTERNAL_TOKEN_FILE, a file holding it, for secrets mounts)
is set, the kvstore, prefill and decode servers refuse every call without
`x-pdserve-internal-token: <token>` in its metadata (UNAUTHENTICATED; health and reflection stay
open), and every channel made by `grpc_server.grpc_channel` attaches it. A service's main reads it
once (`token_from_env`, into its `grpc_server.ProcessConfig`) and hands it to its servers and
channels. The gateway's public port does not check it: clients there use API keys (`gateway.auth`).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from pdserve.interceptors import is_open_method, metadata_adders, metadata_value, refusing

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_INTERNAL_TOKEN_FILE"
METADATA_KEY = "x-pdserve-internal-token"

def token_from_env(env: Mapping[str, str]) -> str:
    """The token of PDSERVE_INTERNAL_TOKEN in `env`, else of the file PDSERVE_INTERNAL_TOKEN_FILE
    names, else "" (none)."""
    token = env.get(TOKEN_ENV, "").strip()
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if not token and path:
        try:
            token = Path(path).read_text().strip()
        except OSError as err:
            raise ValueError(f"{TOKEN_FILE_ENV}={path}: {err.strerror or err}") from err
    return token


def client_interceptors(token: str) -> list[Any]:
    """Interceptors attaching `token` to every call ([] when it is "": none configured)."""
    return metadata_adders(METADATA_KEY, token) if token else []


def server_interceptors(token: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor refusing calls without `token` ([] when it is "": none configured)."""
    return [TokenInterceptor(token)] if token else []


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call but health and reflection that lacks the internal token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or is_open_method(handler_call_details.method):
            return handler
        presented = metadata_value(handler_call_details.invocation_metadata, METADATA_KEY)
        if presented is not None and hmac.compare_digest(presented.encode(), self._token):
            return handler
        what = "lacks" if presented is None else "has a wrong"
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                        f"this internal pdserve service requires the internal token and the call {what} "
                        f"'{METADATA_KEY}'; give the caller the same {TOKEN_ENV} as the service")
