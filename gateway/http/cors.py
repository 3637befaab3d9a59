"""CORS: which web pages on other origins may call the HTTP API from a browser (--allowed-origins).

Off by default (no origin listed): responses carry no CORS header at all and a browser keeps every
other origin's page from reading them. With origins listed (or `*`, any origin):

  - a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) from an allowed
    origin is answered here, 204, before the API-key check: a browser never sends credentials
    with a preflight, so it must not get 401. It allows GET/POST and the request headers a client
    of this API sends (Authorization, Content-Type, X-Request-Id, the OpenAI SDKs' own), for
    `MAX_AGE_S`. A preflight from another origin gets 403 with a message naming the flag;
  - every response to an allowed origin (errors and SSE streams too: the headers are added as the
    response is prepared, before its head is sent) gets Access-Control-Allow-Origin (the origin
    itself) and exposes X-Request-Id, X-Pdserve-Deployment and Retry-After to the page's script.

Every response says `Vary: Origin` while CORS is on: a cache must not hand one origin's answer to
another. Credentials (cookies) are never allowed: the API authenticates with a bearer key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import hdrs, web

from gateway.http.errors import ApiError, Handler, error_response

FLAG = "--allowed-origins"
ANY = "*"
MAX_AGE_S = 600  # how long a browser may cache a preflight's answer (chromium caps it at 7200)
ALLOWED_METHODS = ("GET", "POST", "OPTIONS")
# What clients of an OpenAI-compatible API send: ours, and those of OpenAI's JavaScript SDK.
ALLOWED_HEADERS = ("Authorization", "Content-Type", "X-Request-Id", "Accept", "OpenAI-Organization",
                   "OpenAI-Project", "OpenAI-Beta", "X-Stainless-Arch", "X-Stainless-Lang", "X-Stainless-OS",
                   "X-Stainless-Package-Version", "X-Stainless-Retry-Count", "X-Stainless-Runtime",
                   "X-Stainless-Runtime-Version", "X-Stainless-Timeout")
EXPOSED_HEADERS = ("X-Request-Id", "X-Pdserve-Deployment", "Retry-After")


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """The origins whose pages may call the API ("scheme://host[:port]", or "*"); () = CORS off."""

    origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for origin in self.origins:
            check_origin(origin)

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        if not origin:
            return False
        return ANY in self.origins or origin.rstrip("/").lower() in {o.lower() for o in self.origins}


def check_origin(origin: str) -> str:
    """`origin` when it is "*" or an origin as browsers send it ("https://app.example:8443"), else
    ValueError naming the flag."""
    if origin == ANY:
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{FLAG}: {origin!r} is not an origin; write scheme://host[:port] as the browser's "
                         f"address bar shows it (e.g. http://localhost:3000), or * for any origin")
    try:
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError:
        raise ValueError(f"{FLAG}: {origin!r} has a bad port") from None
    return origin


def parse_origins(values: Iterable[str]) -> CorsConfig:
    """The config of --allowed-origins values (repeatable, each possibly comma-separated)."""
    return CorsConfig(tuple(o.strip().rstrip("/") for v in values for o in v.split(",") if o.strip()))


def is_preflight(request: web.Request) -> bool:
    return (request.method == hdrs.METH_OPTIONS and hdrs.ORIGIN in request.headers
            and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers)


def middleware(config: CorsConfig):  # -> an aiohttp middleware
    """Answers preflights (module docstring); outside the API-key middleware."""
    @web.middleware
    async def cors_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_preflight(request):
            return await handler(request)
        origin = request.headers[hdrs.ORIGIN]
        if not config.allows(origin):
            return error_response(ApiError(
                403, f"origin {origin!r} may not call this API from a browser: start the gateway with "
                     f"{FLAG} {origin} (or {FLAG} '*' for any origin)", code="origin_not_allowed"))
        return web.Response(status=204, headers={
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: ", ".join(ALLOWED_METHODS),
            hdrs.ACCESS_CONTROL_ALLOW_HEADERS: ", ".join(ALLOWED_HEADERS),
            hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S)})
    return cors_preflight


def response_hook(config: CorsConfig):  # -> an on_response_prepare signal handler
    """Adds the CORS headers of an allowed origin to every response as it is prepared."""
    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        _add_vary_origin(response)
        origin = request.headers.get(hdrs.ORIGIN)
        if not config.allows(origin):
            return
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = ", ".join(EXPOSED_HEADERS)
    return add_cors_headers


def _add_vary_origin(response: web.StreamResponse) -> None:
    vary = response.headers.get(hdrs.VARY, "")
    if "origin" not in {v.strip().lower() for v in vary.split(",")}:
        response.headers[hdrs.VARY] = f"{vary}, Origin" if vary else "Origin"


def install(app: web.Application, config: CorsConfig) -> None:
    """Turn CORS on for `app` when `config` lists origins (its middleware must already be in
    the app's middleware list: `middlewares(config)`)."""
    if config.enabled:
        app.on_response_prepare.append(response_hook(config))


def middlewares(config: CorsConfig) -> list:
    """[the preflight middleware] when CORS is on, else []."""
    return [middleware(config)] if config.enabled else []
