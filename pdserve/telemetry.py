"""Tracing for every pdserve process: one tracer provider per service, set up here and only here.

Configuration is a service's `grpc_server.ProcessConfig` (`traces`, `traces_protocol`), which its
main reads from the environment (children inherit it from `pdserve up`; every process of a stack
must agree). The standard OpenTelemetry variables work as the SDK defines them:

    OTEL_TRACES_EXPORTER=otlp|console|none (a comma list too); unset: tracing off (not the SDK's
                                   default otlp: nothing is exported unless asked); OTEL_SDK_DISABLED=true: off
    OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL  grpc (default) or http/protobuf
    OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE
                                   read by the SDK's OTLP exporters themselves
    OTEL_TRACES_SAMPLER(_ARG)      read by the SDK's TracerProvider (default parentbased_always_on)
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES  read by the SDK's Resource; without a service name
                                   it is "pdserve-<service>" (e.g. "pdserve-decode")
    OTEL_BSP_*                     the batch span processor's, read by the SDK
    OTEL_PROPAGATORS               the propagators of W3C trace context (default tracecontext,baggage)

PDSERVE_TRACES, when set, wins over OTEL_TRACES_EXPORTER and adds one exporter the SDK lacks:

    PDSERVE_TRACES=none            no provider, no interceptors, no span objects at all
    PDSERVE_TRACES=otlp | console  as OTEL_TRACES_EXPORTER
    PDSERVE_TRACES=file:/path.jsonl  every finished span appended as one JSON line (tests: every
                                   process of a stack writes the same file)

Every process's resource also has `pdserve.service` (gateway, prefill, decode, kvstore), which
stays when OTEL_SERVICE_NAME names the whole stack.

`configure(service, traces, protocol)` installs the provider (called by `grpc_server.start_server`,
and by a worker before it builds its engine). The provider is process-wide (OpenTelemetry allows
one per process), and so is `enabled()`, which says whether `configure` installed one. W3C trace
context travels in gRPC metadata: `client_interceptors()` (ours, installed by
`grpc_server.grpc_channel`) inject it, `server_interceptors()` (OpenTelemetry's gRPC instrumentation,
opentelemetry-instrumentation-grpc, installed by `start_server`) extract it and wrap each handler in
a SERVER span, so one trace shows gateway -> prefill -> kvstore -> decode.

Which calls are traced, and why (the instrumentation's filters, `_server_traced`/`_client_traced`):
  * server side: every RPC that arrives with a traceparent, plus the front door (the Gateway
    service), which starts traces. Health checks and reflection never are.
  * client side: only calls made inside a live (recording) span. Background chatter (health probes,
    Stats polls, residency reports, a predictor task that outlived the request that spawned it)
    then starts no traces of their own, and stays out of the request traces.
When tracing is off, `enabled()` is False: callers check it before building anything, the grpc
objects carry no interceptors, and `tracer()` is the API's no-op tracer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from pdserve import interceptors

log = logging.getLogger(__name__)

TRACES_ENV = "PDSERVE_TRACES"
OTEL_EXPORTER_ENV = "OTEL_TRACES_EXPORTER"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")  # the SDK's order
PROTOCOLS = ("grpc", "http/protobuf")
TRACER_NAME = "pdserve"
# Services whose RPCs start traces (the client-facing front door).
ROOT_SERVICES = ("pdserve.v1.Gateway",)
_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
_EXPORTERS = ("none", "otlp", "console")

_lock = threading.Lock()
# What `configure` installed: the tracer provider is OpenTelemetry's, one per process, so the
# switch that follows it is too ("none" until a service configures tracing).
_mode = "none"
_configured_service: str | None = None


def check_traces(value: str) -> str:
    """`value` when it names exporters `configure` knows: "none", "otlp", "console", "file:<path>",
    or a comma list of them ("otlp,console")."""
    for part in value.split(","):
        part = part.strip()
        if part not in _EXPORTERS and not (part.startswith("file:") and len(part) > 5):
            raise ValueError(f"{TRACES_ENV} must be none, otlp, console or file:PATH, or a comma list "
                             f"(as {OTEL_EXPORTER_ENV}, which has no file:), got {value!r}")
    return value


def check_protocol(value: str) -> str:
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENVS[0]} / {PROTOCOL_ENVS[1]} must be grpc or http/protobuf "
                         f"(the OTLP exporters Python has), got {value!r}")
    return value


def traces_from_otel_env(env: Mapping[str, str]) -> str | None:
    """The exporters OpenTelemetry's own variables ask for (PDSERVE_TRACES unset): OTEL_TRACES_EXPORTER,
    "none" under OTEL_SDK_DISABLED=true; None when neither is set (tracing stays off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "none"
    value = env.get(OTEL_EXPORTER_ENV, "").strip().lower()
    return ",".join(p.strip() for p in value.split(",")) if value else None


def protocol_from_env(env: Mapping[str, str]) -> str | None:
    """OTLP's transport as the SDK reads it: the traces variable, else the general one."""
    for name in PROTOCOL_ENVS:
        if env.get(name, "").strip():
            return env[name].strip()
    return None


def traces_mode() -> str:
    """The exporters `configure` installed: "none", "otlp", "console", "file:<path>" or a list."""
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


def _exporters(traces: str) -> list[str]:
    return [p.strip() for p in check_traces(traces).split(",") if p.strip() != "none"]


def configure(service: str, traces: str = "none", protocol: str | None = None) -> None:
    """Install this process's tracer provider for `service`, exporting as `traces` says (a
    `check_traces` value; "none": nothing is installed), OTLP over `protocol` (None: as the SDK's
    variables say, the process config's `traces_protocol`: a caller holding no config). Idempotent:
    the first call that turns tracing on wins."""
    global _configured_service, _mode
    exporters = _exporters(traces)
    if not exporters:
        return
    with _lock:
        if _configured_service is not None:
            return
        _configured_service = service
    from opentelemetry.sdk.trace import TracerProvider

    protocol = protocol or protocol_from_env(os.environ) or "grpc"

    # No sampler passed: the SDK reads OTEL_TRACES_SAMPLER / _ARG (default parentbased_always_on).
    provider = TracerProvider(resource=resource_for(service))
    for name in exporters:
        provider.add_span_processor(_span_processor(name, check_protocol(protocol)))
    trace.set_tracer_provider(provider)
    _mode = ",".join(exporters)
    log.info("tracing on for %s: %s%s", service, _mode, f" (OTLP over {protocol})" if "otlp" in exporters else "")


def resource_for(service: str):  # -> opentelemetry.sdk.resources.Resource
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, telemetry.sdk.*) with
    `pdserve.service`, and service.name "pdserve-<service>" unless the environment named one."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({"pdserve.service": service})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"pdserve-{service}"}))
    return resource


def _span_processor(name: str, protocol: str):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if name == "otlp":
        # Each exporter reads its endpoint, headers, timeout, compression and certificate from the
        # standard variables (OTEL_EXPORTER_OTLP_TRACES_* before OTEL_EXPORTER_OTLP_*).
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        return BatchSpanProcessor(OTLPSpanExporter())
    if name == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    # file: written as each span ends, so a test reading the file needs no flush at shutdown.
    return SimpleSpanProcessor(JsonLinesSpanExporter(name.removeprefix("file:")))


def tracer() -> trace.Tracer:
    """pdserve's tracer: a proxy that follows whatever provider `configure` installed (no-op when off)."""
    return trace.get_tracer(TRACER_NAME)


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    """The trace context a request's headers or metadata carry, read by the process's propagators
    (OTEL_PROPAGATORS; W3C traceparent/tracestate and baggage by default)."""
    return propagate.extract(carrier)


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


# ---- gRPC propagation (opentelemetry-instrumentation-grpc, with pdserve's filters) ----------

def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


def _untraced(method: str) -> bool:
    return method.startswith(_UNTRACED_PREFIXES)


def _server_traced(details: grpc.HandlerCallDetails) -> bool:
    """Whether an arriving call gets a SERVER span: the front door's, or one that brings a traceparent."""
    method = _method_name(details.method)
    if _untraced(method):
        return False
    return method.lstrip("/").startswith(ROOT_SERVICES) or _has_traceparent(details.invocation_metadata)


def _has_traceparent(metadata: Iterable[Any] | None) -> bool:
    return any(item[0] == "traceparent" for item in metadata or ())


def _client_traced(details: grpc.aio.ClientCallDetails) -> bool:
    """Whether an outgoing call gets a CLIENT span: made inside a live span (a request's), not a
    health check. Evaluated in the caller's context (grpc.aio runs interceptors in a task that
    copied it)."""
    return not _untraced(_method_name(details.method)) and trace.get_current_span().is_recording()


def client_interceptors(on: bool | None = None) -> list[Any]:
    """Interceptors that trace and propagate every call of a channel ([] when tracing is off).
    `on`: whether the channel's process traces (its config says so before `configure` ran: the
    gateway dials its workers before its server starts); None: whether `configure` turned it on.

    Ours, not the instrumentation's client interceptors: those end a streaming call's span when its
    response iterator is exhausted or closed, and the gateway cancels a Decode stream once it has the
    finish reason, so that span never ended (nor was exported). Ours end it when the call is done."""
    if not (enabled() if on is None else on):
        return []
    return interceptors.client_interceptors_of(_trace_client_call)


async def _trace_client_call(continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                             request: Any) -> Any:
    """A CLIENT span around one call (`_client_traced` ones), its context injected into the call's
    metadata by the process's propagators; named and attributed as the instrumentation's server spans."""
    if not _client_traced(details):
        return await continuation(details, request)
    method = _method_name(details.method)
    service, _, name = method.lstrip("/").partition("/")
    span = tracer().start_span(method, kind=SpanKind.CLIENT, attributes={
        "rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    for key, value in carrier.items():
        metadata.add(key, value)
    details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                         details.credentials, details.wait_for_ready)
    try:
        call = await continuation(details, request)
    except BaseException as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.end()
        raise
    call.add_done_callback(lambda c: _finish_client_span(span, c))
    return call


def _finish_client_span(span: Span, call: Any) -> None:
    async def finish() -> None:
        try:
            code = await call.code()
        except BaseException:  # noqa: BLE001 - the span must end whatever happened
            code = grpc.StatusCode.UNKNOWN
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        # CANCELLED is the caller's choice, not a failure: the gateway cancels a Decode stream once it
        # has the finish reason (or a stop string matched), and clients hang up on purpose.
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
            span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()
    try:
        asyncio.get_running_loop().create_task(finish())
    except RuntimeError:  # no loop (interpreter shutting down): end without a code
        span.end()


def server_interceptors(on: bool | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that opens a SERVER span per traced RPC ([] when tracing is off; `on` as
    for `client_interceptors`)."""
    if not (enabled() if on is None else on):
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_server_traced)]
