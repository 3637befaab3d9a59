"""Tracing for every pdserve process: one tracer provider per service, set up here and only here.

Configuration is a service's `grpc_server.ProcessConfig.traces`, which its main reads from the
environment (children inherit it from `pdserve up`; every process of a stack must agree):

    PDSERVE_TRACES=none            (default) no provider, no interceptors, no span objects at all
    PDSERVE_TRACES=otlp            OTLP/gRPC batch export; endpoint etc. from the standard
                                   OTEL_EXPORTER_OTLP_* variables (default localhost:4317)
    PDSERVE_TRACES=console         finished spans printed to stdout (debugging)
    PDSERVE_TRACES=file:/path.jsonl  every finished span appended as one JSON line (tests: every
                                   process of a stack writes the same file)

`configure(service, traces)` installs the provider (called by `grpc_server.start_server`, and by a
worker before it builds its engine; the service's name becomes `service.name`, e.g.
"pdserve-decode"). The provider is process-wide (OpenTelemetry allows one per process), and so is
`enabled()`, which says whether `configure` installed one. W3C trace context travels in gRPC metadata:
`client_interceptors()` (installed by `grpc_server.grpc_channel`) inject it, `server_interceptors()`
(installed by `start_server`) extract it and wrap each handler in a SERVER span, so one trace shows
gateway -> prefill -> kvstore -> decode.

Which calls are traced, and why:
  * server side: every RPC that arrives with a traceparent, plus the front door (the Gateway
    service), which starts traces. Health checks and reflection never are.
  * client side: only calls made inside a live (recording) span. Background chatter (health probes,
    Stats polls, residency reports, a predictor task that outlived the request that spawned it)
    then starts no traces of its own, and stays out of the request traces.
When tracing is off, `enabled()` is False: callers check it before building anything, the grpc
objects carry no interceptors, and `tracer()` is the API's no-op tracer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve import interceptors

log = logging.getLogger(__name__)

TRACES_ENV = "PDSERVE_TRACES"
TRACER_NAME = "pdserve"
# Services whose RPCs start traces (the client-facing front door).
ROOT_SERVICES = ("pdserve.v1.Gateway",)
_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")

_propagator = TraceContextTextMapPropagator()  # W3C traceparent/tracestate only
_lock = threading.Lock()
# What `configure` installed: the tracer provider is OpenTelemetry's, one per process, so the
# switch that follows it is too ("none" until a service configures tracing).
_mode = "none"
_configured_service: str | None = None


def check_traces(value: str) -> str:
    """`value` when it is an exporter `configure` knows ("none", "otlp", "console", "file:<path>")."""
    if value not in ("none", "otlp", "console") and not (value.startswith("file:") and len(value) > 5):
        raise ValueError(f"{TRACES_ENV} must be none, otlp, console or file:PATH, got {value!r}")
    return value


def traces_mode() -> str:
    """The exporter `configure` installed: "none", "otlp", "console" or "file:<path>"."""
    return _mode


def enabled() -> bool:
    """True when spans are exported; the one check hot paths make before doing any tracing work."""
    return _mode != "none"


def reset_for_tests() -> None:
    """Turn tracing off again for the next test (the provider itself stays: one per process)."""
    global _mode
    _mode = "none"


def service_label(service_names: Sequence[str]) -> str:
    """"pdserve.v1.DecodeWorker" -> "decode": the short name of the process's first service."""
    if not service_names:
        return "unknown"
    short = service_names[0].rsplit(".", 1)[-1]
    return {"PrefillWorker": "prefill", "DecodeWorker": "decode", "KVStore": "kvstore",
            "Gateway": "gateway"}.get(short, short.lower())


def configure(service: str, traces: str = "none") -> None:
    """Install this process's tracer provider for `service`, exporting as `traces` says (a
    `check_traces` value; "none": nothing is installed). Idempotent: the first call that turns
    tracing on wins."""
    global _configured_service, _mode
    if check_traces(traces) == "none":
        return
    with _lock:
        if _configured_service is not None:
            return
        _configured_service = service
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": f"pdserve-{service}"}))
    provider.add_span_processor(_span_processor(traces))
    trace.set_tracer_provider(provider)
    _mode = traces
    log.info("tracing on for %s: %s", service, traces)


def _span_processor(mode: str):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if mode == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter())
    if mode == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    # file: written as each span ends, so a test reading the file needs no flush at shutdown.
    return SimpleSpanProcessor(JsonLinesSpanExporter(mode.removeprefix("file:")))


def tracer() -> trace.Tracer:
    """pdserve's tracer: a proxy that follows whatever provider `configure` installed (no-op when off)."""
    return trace.get_tracer(TRACER_NAME)


def current_span_context() -> trace.SpanContext | None:
    """The live span's context, for linking work done elsewhere (engine steps) to this request."""
    span = trace.get_current_span()
    return span.get_span_context() if span.is_recording() else None


class JsonLinesSpanExporter:
    """Appends each finished span as one JSON line; several processes may share the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        # One O_APPEND write per batch: lines from concurrent processes never interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: Any) -> dict[str, Any]:
    """A finished SDK span as a flat dict (ids in hex, times in ns)."""
    ctx = span.get_span_context()
    return {
        "service": span.resource.attributes.get("service.name", ""),
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [{"trace_id": f"{lk.context.trace_id:032x}", "span_id": f"{lk.context.span_id:016x}"}
                  for lk in span.links],
    }


# ---- gRPC propagation -----------------------------------------------------------------------

def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


def _rpc_attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _untraced(method: str) -> bool:
    return method.startswith(_UNTRACED_PREFIXES)


def client_interceptors(on: bool | None = None) -> list[Any]:
    """Interceptors that trace and propagate every call of a channel ([] when tracing is off).
    `on`: whether the channel's process traces (its config says so before `configure` ran: the
    gateway dials its workers before its server starts); None: whether `configure` turned it on."""
    if not (enabled() if on is None else on):
        return []
    return interceptors.client_interceptors_of(_trace_client_call)


def server_interceptors(on: bool | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that opens a SERVER span per traced RPC ([] when tracing is off; `on` as
    for `client_interceptors`)."""
    return [_ServerTracer()] if (enabled() if on is None else on) else []


async def _trace_client_call(continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                             request: Any) -> Any:
    """A CLIENT span around one call, its context injected into the call's metadata."""
    method = _method_name(details.method)
    if _untraced(method) or not trace.get_current_span().is_recording():
        return await continuation(details, request)
    span = tracer().start_span(method.lstrip("/"), kind=SpanKind.CLIENT, attributes=_rpc_attributes(method))
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    for key, value in carrier.items():
        metadata.add(key, value)
    details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                         details.credentials, details.wait_for_ready)
    try:
        call = await continuation(details, request)
    except BaseException as exc:
        _end_with_error(span, exc)
        raise
    call.add_done_callback(lambda c: _finish_client_span(span, c))
    return call


def _finish_client_span(span: Span, call: Any) -> None:
    async def finish() -> None:
        try:
            code = await call.code()
        except BaseException:  # noqa: BLE001 - the span must end whatever happened
            code = grpc.StatusCode.UNKNOWN
        _end_with_code(span, code)
    try:
        asyncio.get_running_loop().create_task(finish())
    except RuntimeError:  # no loop (interpreter shutting down): end without a code
        span.end()


def _end_with_code(span: Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    # CANCELLED is the caller's choice, not a failure: the gateway cancels a Decode stream once it
    # has the finish reason (or a stop string matched), and clients hang up on purpose.
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _end_with_error(span: Span, exc: BaseException) -> None:
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    span.end()


class _ServerTracer(grpc.aio.ServerInterceptor):
    """Wraps each traced handler so it runs inside a SERVER span continuing the caller's trace."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = _method_name(handler_call_details.method)
        if handler is None or _untraced(method):
            return handler
        carrier = _metadata_dict(handler_call_details.invocation_metadata or ())
        if "traceparent" not in carrier and not method.lstrip("/").startswith(ROOT_SERVICES):
            return handler  # nobody upstream is tracing this call (background traffic)
        parent = _propagator.extract(carrier)
        return _wrap_handler(handler, method, parent)


def _metadata_dict(metadata: Iterable[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in metadata:
        key, value = item[0], item[1]
        if isinstance(value, str):
            out[key] = value
    return out


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str, parent: otel_context.Context
                  ) -> grpc.RpcMethodHandler:
    def start() -> Span:
        return tracer().start_span(method.lstrip("/"), context=parent, kind=SpanKind.SERVER,
                                   attributes=_rpc_attributes(method))

    def finish(span: Span, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        code = _server_code(context, exc)
        _end_with_code(span, code)

    def wrap_unary_response(behavior):
        async def traced(request_or_iterator, context):
            span = start()
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                try:
                    result = await behavior(request_or_iterator, context)
                except BaseException as exc:
                    finish(span, context, exc)
                    raise
            finish(span, context, None)
            return result
        return traced

    def wrap_stream_response(behavior):
        async def traced(request_or_iterator, context):
            span = start()
            with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                try:
                    async for item in interceptors.streamed(behavior, request_or_iterator, context):
                        yield item
                except BaseException as exc:
                    finish(span, context, exc)
                    raise
            finish(span, context, None)
        return traced

    return interceptors.same_kind(handler, wrap_unary_response, wrap_stream_response)


def _server_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    code = None
    try:
        code = context.code()  # set by abort() / set_code(); None when the handler just returned
    except Exception:  # noqa: BLE001 - older grpc: no code() on the aio context
        pass
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN
