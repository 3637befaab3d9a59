"""The aiohttp application and its server, on the event loop that already runs grpc.aio.

`create_app` wires the routes to `ApiHandlers`; `start_http` starts an `AppRunner` + `TCPSite` on
the running loop (no second thread, no ASGI server) and returns an `HttpServer` to close.

Slow clients: a connection must send a whole request head within --http-header-timeout-s of
connecting (or of its last response), else it is closed. That is aiohttp's keep-alive timer, which
starts when the connection opens and closes it if it is still waiting for a request head when the
timer fires (bytes of a half-sent head do not reset it); a running request is never cut by it.
The body has its own bound (handlers, --http-body-timeout-s).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import Counter

from gateway import auth
from gateway.deadlines import Deadlines
from gateway.deployments import Catalog, as_catalog
from gateway.flow import RequestFlow
from gateway.http.errors import Handler, openai_errors
from gateway.http.handlers import ApiHandlers
from gateway.request_limits import RequestLimits
from gateway.slo import SloMonitor
from pdserve.tls import TlsConfig

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter("pdserve_gateway_http_requests", "HTTP API requests answered, by route and status",
                        ["route", "status"])


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count each answered request (a stream counts once, with the status it started with)."""
    response = await handler(request)
    resource = request.match_info.route.resource
    HTTP_REQUESTS.labels(resource.canonical if resource is not None else "unmatched", str(response.status)).inc()
    return response


def create_app(catalog: Catalog | RequestFlow, model_name: str = "default", slo: SloMonitor | None = None, *,
               limits: RequestLimits | None = None, deadlines: Deadlines | None = None,
               keys: auth.KeyRing | None = None) -> web.Application:
    """The HTTP API over `catalog` (its public names are what clients send as `model`; a bare flow is
    one deployment called `model_name`); its requests' TTFTs feed `slo` (pass the gRPC servicer's,
    so one SLO window sees both APIs). `limits` (body size, ids, body timeout) and `deadlines` (each
    request's bound) are the gateway's settings (default: theirs); `keys` the API keys (None: off)."""
    limits = limits or RequestLimits()
    h = ApiHandlers(as_catalog(catalog, model_name), slo, limits=limits, deadlines=deadlines)
    # count_requests sits outside openai_errors, so it sees the error responses too.
    # API keys (gateway.auth) inside openai_errors: refusals are OpenAI error JSON too.
    app = web.Application(middlewares=[count_requests, openai_errors, *auth.http_middlewares(keys)],
                          client_max_size=limits.max_request_bytes)
    app.router.add_post("/v1/chat/completions", h.chat_completions)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/v1/models/{model}", h.model)
    app.router.add_post("/v1/feedback", h.feedback)
    app.router.add_get("/v1/experiments", h.experiments)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/", h.index)
    return app


@dataclass
class HttpServer:
    """A started HTTP API; `close` stops accepting and waits up to `grace_s` for running requests."""

    runner: web.AppRunner
    host: str
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


def split_bind(bind: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError when it is neither."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"HTTP bind address must be host:port, got {bind!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def start_http(app: web.Application, bind: str, grace_s: float = 5.0, *,
                     header_timeout_s: float = RequestLimits().http_header_timeout_s,
                     tls: TlsConfig | None = None) -> HttpServer:
    """Serve `app` on `bind` ("host:port"; port 0 picks a free one) on the running loop; a connection
    gets `header_timeout_s` to send each request head (--http-header-timeout-s); HTTPS when `tls`
    has a certificate (the gateway's, pdserve.tls)."""
    host, port = split_bind(bind)
    # handler_cancellation: a client that disconnects cancels its handler, and with it the
    # request's downstream calls (the default would let it run on, holding KV, until the next write).
    # keepalive_timeout: the slow-header bound (module docstring); aiohttp's default is an hour.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s,
                           keepalive_timeout=header_timeout_s)
    await runner.setup()
    config = tls or TlsConfig()  # HTTPS with the gateway's certificate when it has one (pdserve.tls)
    site = web.TCPSite(runner, host, port, ssl_context=config.http_ssl_context() if config.serves_tls else None)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise OSError(f"cannot bind the HTTP API to {bind!r}: {err.strerror or err}") from err
    bound = runner.addresses[0][1]  # the real port when 0 asked for a free one
    log.info("HTTP API on %s://%s:%d (OpenAI-compatible /v1, chat page at /)",
             "https" if config.serves_tls else "http", host, bound)
    return HttpServer(runner, host, bound)
