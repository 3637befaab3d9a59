"""What every pdserve gRPC service shares: server start/stop, health, reflection, error mapping.

Each service (gateway, prefill, decode, kvstore) starts its grpc.aio server through
`start_server`, so all of them answer `grpc.health.v1.Health` and server reflection the same way,
accept the same message sizes as the channels made by `grpc_channel`, and stop the same way.
Servicer methods wrap themselves in `abort_on` so bad input becomes a gRPC status with a one-line
message instead of a Python traceback in the client.

Observability and security (below) are configured by a `ProcessConfig`, the part of every
service's config (GatewayConfig, KVStoreConfig, WorkerConfig) that is the same whatever the
service: TLS, the internal token, tracing and /metrics. A service's main builds it once, from its
flags and environment, and passes it to `start_server` and `grpc_channel`.

Observability is installed here, so no service has to: `start_server` sets up the process's
tracer provider (`pdserve.telemetry`, PDSERVE_TRACES or the OTEL_* variables) and the tracing
server interceptor, and serves the service's own Prometheus registry (`pdserve.metric_registries`)
on --metrics-port / PDSERVE_METRICS_PORT when that is set (on the service's bind host unless
--metrics-host / PDSERVE_METRICS_HOST says otherwise);
`grpc_channel` adds the client interceptors that propagate W3C trace context. With tracing off
(the default) neither carries any interceptor.

Security is installed here for the same reason (docs/security.md): `start_server` serves TLS when
the process has a certificate (`pdserve.tls`, PDSERVE_TLS_*), and an internal server (not
`public`) requires client certificates under PDSERVE_TLS_CLIENT_AUTH and the internal token
(`pdserve.internal_auth`) when one is configured; `grpc_channel` dials TLS and attaches the token
the same way. The public gateway passes its own interceptors (API keys) and receive limit.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import signal
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve import internal_auth, telemetry, thread_policy
from pdserve.config_flags import build, nested, setting
from pdserve.grpc_decode import DecodeErrorInterceptor
from pdserve.tls import TlsConfig

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
METRICS_PORT_ENV = "PDSERVE_METRICS_PORT"
# /metrics has no key: by default it listens where the service does (a loopback service keeps it on
# loopback; one that Prometheus must reach on 0.0.0.0 exposes it there too).
METRICS_HOST_ENV = "PDSERVE_METRICS_HOST"
SERVICE_THREADS_ENV = "PDSERVE_SERVICE_THREADS"
DEFAULT_METRICS_HOST = "127.0.0.1"  # when neither the flag nor a bind address says
_metrics_port: int | None = None  # the port this process serves /metrics on, once started


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    """What every pdserve service process has, whatever the service: how its gRPC servers and
    channels are secured and traced, and where it serves /metrics. Part of each service's config."""

    tls: TlsConfig = nested(TlsConfig, "TLS of every gRPC port and channel (PDSERVE_TLS_*; pdserve.tls)")
    # Environment only: a secret never goes on a command line (ps shows those to every user).
    internal_token: str = setting("", "the internal token internal servers demand and channels send "
                                  "(pdserve.internal_auth)", flag=None, load=internal_auth.token_from_env, repr=False)
    # Environment only, as TLS: every process of a stack must agree, and the channels KVStoreClient
    # and WorkerPool make (they take no ProcessConfig yet) trace as the environment says.
    # PDSERVE_TRACES, else OpenTelemetry's OTEL_TRACES_EXPORTER (pdserve.telemetry); unset: off.
    traces: str = setting("none", "span export: none, otlp (OTEL_EXPORTER_OTLP_* say where), console, or "
                          "file:PATH (JSON lines; pdserve.telemetry)", flag=None, env=telemetry.TRACES_ENV,
                          load=telemetry.traces_from_otel_env)
    traces_protocol: str = setting("grpc", "OTLP transport: grpc or http/protobuf", flag=None,
                                   load=telemetry.protocol_from_env)
    metrics_port: int | None = setting(None, "serve Prometheus /metrics on this port (0: a free one)",
                                       env=METRICS_PORT_ENV, type=int, metavar="PORT", shown="off")
    metrics_host: str = setting("", "address /metrics listens on (it has no key: keep it off public "
                                "interfaces)", env=METRICS_HOST_ENV, metavar="HOST", shown="the service's bind host")
    service_threads: str = setting("auto", "scheduling policy of the process's service threads (gRPC, asyncio): "
                                   "batch (SCHED_BATCH: their wake-ups do not preempt an engine's threads mid-step), "
                                   "normal, or auto: batch in the gateway and the kvstore, normal in a worker "
                                   "(pdserve.thread_policy)", env=SERVICE_THREADS_ENV,
                                   choices=thread_policy.POLICIES)

    def __post_init__(self) -> None:
        telemetry.check_traces(self.traces)
        telemetry.check_protocol(self.traces_protocol)
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port / {METRICS_PORT_ENV} must be in 0..65535, got {self.metrics_port}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProcessConfig:
        """The config the environment `env` describes (no flags)."""
        return build(cls, None, env)

    @property
    def tracing(self) -> bool:
        return self.traces != "none"

# Health servicers of the servers started here, so stop_server can flip them to NOT_SERVING
# before draining (load balancers stop routing to a server that says it is going away).
_health_of: weakref.WeakKeyDictionary[grpc.aio.Server, health.aio.HealthServicer] = \
    weakref.WeakKeyDictionary()


def message_size_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                         max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """gRPC channel/server options setting both message size limits to `max_message_bytes`
    (the receive limit to `max_receive_bytes` when given: a larger message fails RESOURCE_EXHAUSTED)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
    ]


async def start_server(
    bind: str,
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_receive_bytes: int | None = None,
    public: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    process: ProcessConfig | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server on `bind` ("host:port"; port 0 picks a free one).

    `add_servicers` registers the service's servicers; `service_names` are their full names
    (e.g. "pdserve.v1.KVStore"), marked SERVING in health and listed by reflection.
    A `public` server (the gateway) checks neither the internal token nor client certificates;
    `interceptors` run after tracing and the token check. `process`: the service's TLS, token,
    tracing and /metrics (default: none of them). Returns the server and its port.
    """
    process = process or ProcessConfig()
    service = telemetry.service_label(service_names)
    telemetry.configure(service, process.traces, process.traces_protocol)
    start_metrics_http(process.metrics_port, process.metrics_host or bind_host(bind), service)
    access = [] if public else internal_auth.server_interceptors(process.internal_token)
    # Without SO_REUSEPORT (grpc's default is on) a second server on a taken port fails to bind,
    # loudly, instead of silently taking half its connections; another local process of the same
    # user can no longer listen on our port beside us and answer our clients.
    options = [*message_size_options(max_message_bytes, max_receive_bytes), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options,
                             interceptors=[*telemetry.server_interceptors(process.tracing), *access, *interceptors,
                                           DecodeErrorInterceptor()])
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = _bind(server, bind, public, process.tls)
    await server.start()
    for name in [health.OVERALL_HEALTH, *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _health_of[server] = health_servicer
    log.info("serving %s on %s (port %d%s)", ", ".join(service_names), bind, port, _security_note(public, process))
    return server, port


def start_metrics_http(port: int | None = None, host: str = DEFAULT_METRICS_HOST, service: str = "") -> int | None:
    """Serve `service`'s Prometheus registry (pdserve.metric_registries: a worker's has no gateway
    families, and so on) at http://host:port/metrics, once per process; the port it serves on (that
    of the first call that started it), or None when `port` is None (off). A busy port is logged,
    not fatal: metrics must never keep a service from serving."""
    global _metrics_port
    if _metrics_port is not None or port is None:
        return _metrics_port
    from prometheus_client import start_http_server

    from pdserve import metric_registries

    host = host or DEFAULT_METRICS_HOST  # "" (no --metrics-host) without a service's bind: loopback, never all

    try:
        server, _ = start_http_server(port, addr=host, registry=metric_registries.for_service(service))
    except (OSError, ValueError) as err:
        log.warning("cannot serve /metrics on %s port %d (--metrics-host/--metrics-port, %s/%s): %s", host, port,
                    METRICS_HOST_ENV, METRICS_PORT_ENV, err)
        return None
    _metrics_port = server.server_port
    log.info("serving Prometheus metrics on %s port %d", host, _metrics_port)
    return _metrics_port


def bind_host(bind: str) -> str:
    """The host of a "host:port" / "[v6]:port" bind address (DEFAULT_METRICS_HOST when it has none)."""
    host = bind.rpartition(":")[0].strip("[]")
    return host or DEFAULT_METRICS_HOST


def _security_note(public: bool, process: ProcessConfig) -> str:
    config = process.tls
    note = "" if not config.serves_tls else ", mutual TLS" if config.client_auth and not public else ", TLS"
    return note + (", internal token required" if not public and process.internal_token else "")


def _bind(server: grpc.aio.Server, bind: str, public: bool, config: TlsConfig) -> int:
    # Depending on the grpc version a failed bind returns 0 or raises; make both one clear error.
    try:
        if config.serves_tls:
            port = server.add_secure_port(bind, config.server_credentials(public))
        else:
            port = server.add_insecure_port(bind)
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC server to {bind!r}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {bind!r}")
    return port


async def stop_server(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Report NOT_SERVING, then stop accepting calls and let running ones finish for `grace_s`."""
    health_servicer = _health_of.pop(server, None)
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


async def mark_not_serving(server: grpc.aio.Server, reason: str, level: int = logging.ERROR) -> None:
    """Report NOT_SERVING for every service of `server` from now on, while it keeps answering
    calls (e.g. UNAVAILABLE: its engine failed; or draining), so health probes route around it.
    Final: the health servicer ignores later SERVING updates, as in a graceful shutdown."""
    health_servicer = _health_of.get(server)
    if health_servicer is None:
        return
    log.log(level, "reporting NOT_SERVING: %s", reason)
    await health_servicer.enter_graceful_shutdown()


async def serve_until_signal(server: grpc.aio.Server, grace_s: float = 5.0,
                             drain: Callable[[], Awaitable[object]] | None = None) -> None:
    """Run until SIGINT or SIGTERM arrives, then stop gracefully. With `drain` (a worker's:
    pdserve.drain), first report NOT_SERVING and await `drain()` while the server keeps serving
    the calls in flight (and health: a worker that stopped answering its probes would have its
    streams given up by the gateway before they finish), then stop it."""
    # Not server.wait_for_termination(): cancelling that wait cancels grpc's shared shutdown
    # future, which then makes server.stop() raise CancelledError.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        if drain is not None:
            await mark_not_serving(server, "shutting down: draining", level=logging.INFO)
            await drain()
        log.info("stopping gRPC server (grace %.1f s)", grace_s)
        await stop_server(server, grace_s)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


# A peer that went away (crash, restart) is dialled again at least every 2 s: gRPC's default backoff
# grows to 120 s, and after a 40 s kvstore outage clients took 33 s to notice it was back.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]


def grpc_channel(target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 process: ProcessConfig | None = None) -> grpc.aio.Channel:
    """An aio channel to `target` accepting the same message sizes as our servers, which
    propagates trace context when `process` traces, dials TLS when it has a certificate or CA
    (`pdserve.tls`), and attaches its internal token when it has one.

    Without `process`, the environment's: KVStoreClient and WorkerPool make their channels
    without one for now (they take no ProcessConfig yet), and must dial as their service's main
    configured it, which it did from the same environment."""
    if process is None:
        process = ProcessConfig.from_env(os.environ)
    config = process.tls
    options = [*message_size_options(max_message_bytes), *config.channel_options(), *RECONNECT_OPTIONS]
    interceptors = [*telemetry.client_interceptors(process.tracing),
                    *internal_auth.client_interceptors(process.internal_token)] or None
    if config.dials_tls:
        return grpc.aio.secure_channel(target, config.channel_credentials(), options=options,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


class ServiceError(Exception):
    """Raise from a servicer to fail the call with a chosen status code and message.

    `retry_after_s`: when the client should try again (overload); `abort_on` sends it as the
    trailing metadata "retry-after" (whole seconds, as HTTP's header) and "grpc-retry-pushback-ms"
    (what gRPC's own retry policy honours)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


def _trailers_of(exc: Exception) -> tuple[tuple[str, str], ...]:
    after = getattr(exc, "retry_after_s", None)
    if after is None:
        return ()
    return (("retry-after", str(max(1, math.ceil(after)))), ("grpc-retry-pushback-ms", str(round(after * 1000))))


DEFAULT_ERROR_CODES: Mapping[type[BaseException], grpc.StatusCode] = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    KeyError: grpc.StatusCode.NOT_FOUND,
    TimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotImplementedError: grpc.StatusCode.UNIMPLEMENTED,
}


def _status_for(exc: Exception, codes: Mapping[type[BaseException], grpc.StatusCode]
                ) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    for exc_type, code in codes.items():
        if isinstance(exc, exc_type):
            # KeyError's str() is the repr of the key; use the bare argument.
            detail = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            return code, detail or type(exc).__name__
    log.exception("unexpected error in gRPC handler")
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def abort_on(codes: Mapping[type[BaseException], grpc.StatusCode] = DEFAULT_ERROR_CODES,
             public: Callable[[str], str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an async servicer method so exceptions end the call with a status, no traceback.

    Exceptions are matched against `codes` in order (default: ValueError → INVALID_ARGUMENT,
    KeyError → NOT_FOUND, ...); `ServiceError` carries its own code; anything else is logged here
    and reported as INTERNAL. Works for unary and streaming handlers (async generators too).
    The handler must take (self, request_or_iterator, context). `public` rewrites each message
    before it leaves (a client-facing service hides its internal addresses; the log keeps them).
    """
    def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
        code, message = _status_for(exc, codes)
        if public is not None and (shown := public(message)) != message:
            log.info("call failed with %s: %s", code.name, message)  # the detail the client does not get
            message = shown
        return code, message

    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for item in method(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise  # the handler already chose a status
                except Exception as exc:  # noqa: BLE001 - turned into a status below
                    await context.abort(*status_of(exc), trailing_metadata=_trailers_of(exc))
            return stream_wrapper

        @functools.wraps(method)
        async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await method(self, request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await context.abort(*status_of(exc), trailing_metadata=_trailers_of(exc))
        return unary_wrapper
    return decorate
