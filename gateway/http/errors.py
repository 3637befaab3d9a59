"""Every failure of the HTTP API as OpenAI's error JSON, mapped to a status in one place.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`api_error_of` turns whatever a handler or the request flow raised into an `ApiError`:
ValueError (bad prompt, bad sampling value) -> 400, `ServiceError` by its gRPC code
(RESOURCE_EXHAUSTED -> 429, ALREADY_EXISTS -> 409, UNAVAILABLE -> 503, DEADLINE_EXCEEDED -> 504, ...), aiohttp's own
HTTP errors (unknown route, wrong method, body too large) keep their status; anything else is
logged with its traceback here and answered 500 without one. A ServiceError's message names the
workers it involved ("decode worker 10.0.3.7:50052 ..."): the client gets it with every address
replaced (`public_message`; the deployment's topology is not the client's business), the gateway's
log keeps the original. The `openai_errors` middleware
applies it to every response that has not started; a stream that has started reports the same
body as an SSE event (see `handlers`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from gateway.redact import public_message
from pdserve.grpc_server import ServiceError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with everything its OpenAI-shaped response needs."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# gRPC status of the flow -> (HTTP status, OpenAI error type, code). Codes the flow does not raise
# today still get a sensible answer rather than a 500.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", None),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),  # gateway.request_ids
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "timeout"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "invalid_request_error", "not_implemented"),
}

# Statuses a client should retry after a pause: tell it how long (OpenAI's SDK honours this).
_RETRY_AFTER_S = {429: "1", 503: "1"}


def api_error_of(exc: BaseException) -> ApiError:
    """The ApiError for anything raised while serving a request (logs the unexpected ones)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ServiceError):
        status, type_, code = _GRPC_TO_HTTP.get(exc.code, (500, "server_error", "internal_error"))
        message = public_message(str(exc))
        if status == 500:
            log.warning("request failed with %s: %s", exc.code.name, exc)
        elif message != str(exc):
            log.info("request failed with %s: %s", exc.code.name, exc)  # the detail the client does not get
        return ApiError(status, message, type=type_, code=code, headers=_retry_after(status, exc.retry_after_s))
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc) or "invalid request")
    if isinstance(exc, web.HTTPException):
        return _of_http_exception(exc)
    log.error("unexpected error in an HTTP handler", exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); see the gateway log",
                    type="server_error", code="internal_error")


def _retry_after(status: int, hint_s: float | None = None) -> dict[str, str]:
    """The Retry-After header: the flow's own hint (overload: when the queue should have drained),
    else the status's default."""
    seconds = str(max(1, math.ceil(hint_s))) if hint_s is not None else _RETRY_AFTER_S.get(status)
    return {"Retry-After": seconds} if seconds else {}


def _of_http_exception(exc: web.HTTPException) -> ApiError:
    """aiohttp's routing and body-size errors, with a message that says what to do instead."""
    if isinstance(exc, web.HTTPNotFound):
        message = ("no such endpoint; the API serves /v1/chat/completions, /v1/completions, /v1/models, "
                   "/tokenize, /detokenize, /version and /health")
        return ApiError(404, message, code="unknown_url")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(405, f"method {exc.method} is not allowed here; use {allowed}",
                        code="method_not_allowed")
    message = exc.text or exc.reason
    return ApiError(exc.status, message, type="invalid_request_error" if exc.status < 500 else "server_error")


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers, dumps=json_dumps)


def json_dumps(obj: Any) -> str:
    # Compact and UTF-8 as is: SSE events are small and many; non-ASCII text stays readable.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure before the response started as OpenAI error JSON; never a traceback."""
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise  # the client went away: nobody to answer
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like are not errors
        return error_response(api_error_of(exc))
    except Exception as exc:  # noqa: BLE001 - every error becomes a response here, in one place
        return error_response(api_error_of(exc))
