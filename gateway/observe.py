"""What the gateway records about each request: Prometheus metrics, the request span, the SLO feed.

`RequestObserver` is opened by the servicer around one request's stream (`gateway.service`) and told
about every chunk and how the stream ended:

  pdserve_requests_total{status}    one per request, status = the gRPC code name ("OK", "CANCELLED", ...)
  pdserve_requests_in_flight        requests being streamed now
  pdserve_ttft_seconds              arrival -> first token
  pdserve_tpot_seconds              (end - first token) / (output tokens - 1), requests with 2+ tokens
  pdserve_e2e_seconds               arrival -> last chunk
  pdserve_queue_seconds             arrival -> the request handed to a prefill worker (gateway-side
                                    wait: tokenizing, admission, kvstore lookup, routing); observed
                                    when the flow calls `mark_dispatched()`
  pdserve_output_tokens_total       generated tokens streamed

With tracing on, the request runs inside a "gateway.request" span (child of the RPC's SERVER span)
so every downstream call of the flow is its child; with tracing off no span is made. An HTTP request
gets its SERVER span from `http_server_span` (the app's middleware): its parent is the caller's W3C
`traceparent` header when it sent one (read by OpenTelemetry's propagator, as the gRPC interceptor
reads the call's metadata), so a client's trace continues through the gateway on both APIs.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager

import grpc
from prometheus_client import Counter, Gauge, Histogram

from gateway.slo import SloMonitor
from pdserve import telemetry
from pdserve.grpc_server import DEFAULT_ERROR_CODES, ServiceError

# Millisecond-resolving at the low end (stories260K TTFTs are a few ms), up to a minute for e2e.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                   0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 1.0)

REQUESTS = Counter("pdserve_requests", "Requests the gateway finished, by gRPC status", ["status"])
IN_FLIGHT = Gauge("pdserve_requests_in_flight", "Requests the gateway is streaming now")
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token at the gateway", buckets=LATENCY_BUCKETS)
TPOT = Histogram("pdserve_tpot_seconds", "Time per output token after the first", buckets=TPOT_BUCKETS)
E2E = Histogram("pdserve_e2e_seconds", "Request latency from arrival to the last chunk", buckets=LATENCY_BUCKETS)
QUEUE = Histogram("pdserve_queue_seconds", "Arrival until the request is handed to a prefill worker",
                  buckets=LATENCY_BUCKETS)
OUTPUT_TOKENS = Counter("pdserve_output_tokens", "Generated tokens streamed by the gateway")

_current: contextvars.ContextVar["RequestObserver | None"] = contextvars.ContextVar("pdserve_request", default=None)


def mark_dispatched() -> None:
    """The current request is being handed to a prefill worker (called by the flow; no-op outside)."""
    obs = _current.get()
    if obs is not None:
        obs.dispatched()


def status_of(exc: BaseException | None) -> str:
    """The gRPC code name a client sees for a stream that ended with `exc` (None: OK)."""
    if exc is None:
        return grpc.StatusCode.OK.name
    if isinstance(exc, ServiceError):
        return exc.code.name
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.name
    if isinstance(exc, grpc.aio.AbortError):
        return "ABORTED_BY_HANDLER"
    for exc_type, code in DEFAULT_ERROR_CODES.items():
        if isinstance(exc, exc_type):
            return code.name
    return grpc.StatusCode.INTERNAL.name


class RequestObserver:
    """Timestamps of one request; `finish` records everything exactly once."""

    def __init__(self, slo: SloMonitor | None, clock=time.perf_counter) -> None:
        self._clock = clock
        self._slo = slo
        self.start = clock()
        self.first_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.dispatched_at: float | None = None
        self.output_tokens = 0
        self.finished = False

    def dispatched(self) -> None:
        if self.dispatched_at is None:
            self.dispatched_at = self._clock()
            QUEUE.observe(self.dispatched_at - self.start)

    def chunk(self, num_tokens: int) -> None:
        now = self._clock()
        self.last_chunk_at = now
        if num_tokens and self.first_token_at is None:
            self.first_token_at = now
            ttft = now - self.start
            TTFT.observe(ttft)
            if self._slo is not None:
                self._slo.observe_ttft(ttft)
        self.output_tokens += num_tokens

    def finish(self, status: str) -> None:
        if self.finished:
            return
        self.finished = True
        REQUESTS.labels(status=status).inc()
        OUTPUT_TOKENS.inc(self.output_tokens)
        end = self.last_chunk_at if self.last_chunk_at is not None else self._clock()
        if status == "OK":
            E2E.observe(end - self.start)
            if self.first_token_at is not None and self.output_tokens > 1:
                TPOT.observe((end - self.first_token_at) / (self.output_tokens - 1))


@contextmanager
def observe_request(request_id: str, session_id: str, slo: SloMonitor | None) -> Iterator[RequestObserver]:
    """Count the request in flight, run the block inside its span (tracing on), record its end.

    The caller reports how the stream ended by letting the exception through (or not)."""
    obs = RequestObserver(slo)
    token = _current.set(obs)
    IN_FLIGHT.inc()
    with ExitStack() as stack:
        span = None
        if telemetry.enabled():
            span = stack.enter_context(telemetry.tracer().start_as_current_span(
                "gateway.request", record_exception=False, set_status_on_exception=False,
                attributes={"pdserve.request_id": request_id, "pdserve.session_id": session_id}))
        try:
            yield obs
        except BaseException as exc:
            status = status_of(exc)
            obs.finish(status)
            if span is not None:
                _annotate(span, obs, status)
            raise
        else:
            obs.finish("OK")
            if span is not None:
                _annotate(span, obs, "OK")
        finally:
            IN_FLIGHT.dec()
            try:
                _current.reset(token)
            except ValueError:  # closed from another context (a garbage-collected stream)
                pass


@contextmanager
def http_server_span(method: str, route: str, headers: Mapping[str, str]) -> Iterator[object | None]:
    """The SERVER span of one HTTP request ("POST /v1/chat/completions"), current for the block and
    continuing the trace of the request's `traceparent` header when it has one; None when tracing is
    off. Tell it the response's status with `set_http_status(span, status)`."""
    if not telemetry.enabled():
        yield None
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(headers)  # W3C traceparent/tracestate, as gRPC's
    with telemetry.tracer().start_as_current_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER, record_exception=False,
            attributes={"http.request.method": method, "http.route": route}) as span:
        yield span


def set_http_status(span, status: int) -> None:
    """Record an HTTP response's status on its span (`http_server_span`); 5xx marks it an error."""
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))


def _annotate(span, obs: RequestObserver, status: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("pdserve.status", status)
    span.set_attribute("pdserve.output_tokens", obs.output_tokens)
    if obs.first_token_at is not None:
        span.set_attribute("pdserve.ttft_ms", round((obs.first_token_at - obs.start) * 1000, 3))
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, status))
