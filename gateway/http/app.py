"""The aiohttp application and its server, on the event loop that already runs grpc.aio.

`create_app` wires the routes to `ApiHandlers`; `start_http` starts an `AppRunner` + `TCPSite` on
the running loop (no second thread, no ASGI server) and returns an `HttpServer` to close.

Slow clients: a connection must send a whole request head within --http-header-timeout-s of
connecting (or of its last response), else it is closed. That is aiohttp's keep-alive timer, which
starts when the connection opens and closes it if it is still waiting for a request head when the
timer fires (bytes of a half-sent head do not reset it); a running request is never cut by it.
The body has its own bound (handlers, --http-body-timeout-s). A response sent before its request's
body was read (a 408, 413 or 401) closes the connection after at most LINGER_S more seconds.

Around every handler, outermost first (docs/http-surface.md):
  `trace_requests`  the request's SERVER span, continuing the caller's W3C `traceparent` (tracing on);
  `count_requests`  pdserve_gateway_http_requests_total{route,status};
  CORS preflights   answered before the API-key check (gateway.http.cors; --allowed-origins);
  `openai_errors`   every failure as OpenAI error JSON;
  the API keys      (gateway.auth), for everything but /health and the chat page.
As each response is prepared (errors and SSE streams alike) it gets its `X-Request-Id`: the one the
handler set (a completion's), else the client's own when valid, else a fresh one; and, with CORS
on, the CORS headers of an allowed origin.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import Counter

from gateway import auth
from gateway.deadlines import Deadlines
from gateway.deployments import Catalog, as_catalog
from gateway.flow import RequestFlow
from gateway.http import cors
from gateway.http.errors import Handler, openai_errors
from gateway.http.handlers import REQUEST_ID_HEADER, ApiHandlers
from gateway.http.utility import UtilityHandlers
from gateway.observe import http_server_span, set_http_status
from gateway.request_ids import new_id
from gateway.request_limits import RequestLimits
from gateway.slo import SloMonitor
from pdserve.tls import TlsConfig

log = logging.getLogger(__name__)
# How long aiohttp's lingering close goes on reading (and dropping) the rest of a body its response did
# not read, so that the client gets the response before a reset. Its default is 10 s: a slow-body
# client got 10 s past --http-body-timeout-s, and a 413's sender 10 s more of upload. A client sending
# at a normal pace finishes within this; one that trickles is cut.
LINGER_S = 2.0

# Requests to these start a trace of their own; others (/health, /metrics, the page) only continue one.
TRACED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
HTTP_REQUESTS = Counter("pdserve_gateway_http_requests", "HTTP API requests answered, by route and status",
                        ["route", "status"])


@web.middleware
async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count each answered request (a stream counts once, with the status it started with)."""
    response = await handler(request)
    resource = request.match_info.route.resource
    HTTP_REQUESTS.labels(resource.canonical if resource is not None else "unmatched", str(response.status)).inc()
    return response


@web.middleware
async def trace_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's SERVER span (gateway.observe.http_server_span) when tracing is on and the request
    is traced: one of the API's (not /health, /metrics or the page) or one that sent a traceparent.

    Ours rather than opentelemetry-instrumentation-aiohttp-server's middleware: that one is
    configured only by AioHttpServerInstrumentor().instrument(), which replaces aiohttp's
    web.Application class process-wide (every app made after, tests' included), and it traces every
    request its URL-regex list does not exclude, so each health probe would start a trace. The
    span is the same (name "METHOD route", http.* attributes, the process's propagators)."""
    if "traceparent" not in request.headers and not request.path.startswith(TRACED_PREFIXES):
        return await handler(request)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    with http_server_span(request.method, route, request.headers) as span:
        response = await handler(request)
        if span is not None:
            set_http_status(span, response.status)
        return response


def request_id_hook(max_chars: int):  # -> an on_response_prepare signal handler
    """Gives every response an X-Request-Id: the handler's own (completions set theirs), else the
    client's when it is 1..`max_chars` printable ASCII characters (--max-id-chars), else a new one."""
    valid = re.compile(rf"[\x20-\x7e]{{1,{max_chars}}}")

    async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
        if REQUEST_ID_HEADER in response.headers:
            return
        sent = request.headers.get(REQUEST_ID_HEADER, "").strip()
        response.headers[REQUEST_ID_HEADER] = sent if valid.fullmatch(sent) else new_id()
    return add_request_id


def create_app(catalog: Catalog | RequestFlow, model_name: str = "default", slo: SloMonitor | None = None, *,
               limits: RequestLimits | None = None, deadlines: Deadlines | None = None,
               keys: auth.KeyRing | None = None, cors_config: cors.CorsConfig | None = None) -> web.Application:
    """The HTTP API over `catalog` (its public names are what clients send as `model`; a bare flow is
    one deployment called `model_name`); its requests' TTFTs feed `slo` (pass the gRPC servicer's,
    so one SLO window sees both APIs). `limits` (body size, ids, body timeout) and `deadlines` (each
    request's bound) are the gateway's settings (default: theirs); `keys` the API keys (None: off);
    `cors_config` the origins whose pages may call it (None: CORS off)."""
    limits = limits or RequestLimits()
    cors_config = cors_config or cors.CorsConfig()
    catalog = as_catalog(catalog, model_name)
    h = ApiHandlers(catalog, slo, limits=limits, deadlines=deadlines)
    u = UtilityHandlers(catalog, limits)
    # count_requests sits outside openai_errors, so it sees the error responses too; the CORS
    # preflight outside the API keys (a preflight carries none). API keys (gateway.auth) inside
    # openai_errors: refusals are OpenAI error JSON too.
    app = web.Application(middlewares=[trace_requests, count_requests, *cors.middlewares(cors_config),
                                       openai_errors, *auth.http_middlewares(keys)],
                          client_max_size=limits.max_request_bytes)
    app.on_response_prepare.append(request_id_hook(limits.max_id_chars))
    cors.install(app, cors_config)
    app.router.add_post("/v1/chat/completions", h.chat_completions)
    app.router.add_post("/v1/completions", h.completions)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/v1/models/{model}", h.model)
    app.router.add_post("/v1/feedback", h.feedback)
    app.router.add_get("/v1/experiments", h.experiments)
    app.router.add_get("/health", h.health)
    app.router.add_post("/tokenize", u.tokenize)
    app.router.add_post("/detokenize", u.detokenize)
    app.router.add_get("/version", u.version_info)
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


_QUOTED_BYTES = re.compile(r"""b['"].*""", re.S)  # a bytes literal the parser quotes, to the end


class MalformedRequestLines(logging.Filter):
    """aiohttp logs a request it could not parse (a header line past 8 KB, too many headers, a broken
    request line or chunk) at ERROR with a traceback, after it has answered 400. Such a request is
    the client's mistake, and a peer sending garbage must not fill the log with tracebacks (ten lines
    each): one WARNING line instead, naming the peer and the parser's reason, without the bytes the
    reason quotes (a header line can hold a credential: pdserve.log_privacy). Errors of our handlers
    (a 500) keep their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = _QUOTED_BYTES.sub("<bytes hidden>", str(exc.message))
            record.msg, record.args = "%s: answered 400: %s: %s", (record.getMessage(), type(exc).__name__, reason)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def _one_line_malformed_requests() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLines) for f in server_log.filters):
        server_log.addFilter(MalformedRequestLines())


async def start_http(app: web.Application, bind: str, grace_s: float = 5.0, *,
                     header_timeout_s: float = RequestLimits().http_header_timeout_s,
                     tls: TlsConfig | None = None) -> HttpServer:
    """Serve `app` on `bind` ("host:port"; port 0 picks a free one) on the running loop; a connection
    gets `header_timeout_s` to send each request head (--http-header-timeout-s); HTTPS when `tls`
    has a certificate (the gateway's, pdserve.tls)."""
    host, port = split_bind(bind)
    _one_line_malformed_requests()
    # handler_cancellation: a client that disconnects cancels its handler, and with it the
    # request's downstream calls (the default would let it run on, holding KV, until the next write).
    # keepalive_timeout: the slow-header bound (module docstring); aiohttp's default is an hour.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=grace_s,
                           keepalive_timeout=header_timeout_s, lingering_time=LINGER_S)
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
