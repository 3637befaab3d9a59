"""What the gateway records about each request: Prometheus metrics, the request span, the SLO feed.

`RequestObserver` is opened by the servicer around one request's stream (`gateway.service`,
`gateway.http.handlers`), told which deployment serves it and what was asked (`describe`, once it
is routed), about every chunk (`output`) and how the stream ended. Request metrics carry
`model_name`, the deployment's public name (as vLLM's), "" for a request that failed before routing:

  pdserve_requests_total{status,model_name}  one per request, status = the gRPC code name ("OK", ...)
  pdserve_requests_in_flight                 requests being streamed now (not by model: a request
                                             is in flight before it is routed)
  pdserve_ttft_seconds                       arrival -> first token
  pdserve_inter_token_latency_seconds        each token's gap after the one before it (a chunk of n
                                             tokens after a gap g: n observations of g / n)
  pdserve_tpot_seconds                       (end - first token) / (output tokens - 1), requests with 2+ tokens
  pdserve_e2e_seconds                        arrival -> last chunk
  pdserve_queue_seconds                      arrival -> the request handed to a prefill worker (gateway-side
                                             wait: tokenizing, admission, kvstore lookup, routing); observed
                                             when the flow calls `mark_dispatched()`
  pdserve_output_tokens_total                generated tokens streamed
  pdserve_prompt_tokens_total                prompt tokens of each answered choice (from its usage)

With tracing on, the request runs inside a "gateway.request" span (child of the RPC's or the HTTP
request's SERVER span) so every downstream call of the flow is its child; with tracing off no span
is made. The span carries the GenAI semantic conventions' attributes: gen_ai.operation.name (chat,
text_completion), gen_ai.request.model / max_tokens / temperature / top_p, gen_ai.response.id /
finish_reasons, gen_ai.usage.input_tokens / output_tokens. An HTTP request gets its SERVER span from
`http_server_span` (the app's middleware): its parent is the caller's W3C `traceparent` header when
it sent one (read by the process's propagator, as the gRPC interceptor reads the call's metadata),
so a client's trace continues through the gateway on both APIs.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

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
MODEL = "model_name"  # the label vLLM and its dashboards use

REQUESTS = Counter("pdserve_requests", "Requests the gateway finished, by gRPC status", ["status", MODEL])
IN_FLIGHT = Gauge("pdserve_requests_in_flight", "Requests the gateway is streaming now")
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token at the gateway", [MODEL], buckets=LATENCY_BUCKETS)
ITL = Histogram("pdserve_inter_token_latency_seconds", "Gap between consecutive output tokens at the gateway",
                [MODEL], buckets=TPOT_BUCKETS)
TPOT = Histogram("pdserve_tpot_seconds", "Time per output token after the first", [MODEL], buckets=TPOT_BUCKETS)
E2E = Histogram("pdserve_e2e_seconds", "Request latency from arrival to the last chunk", [MODEL],
                buckets=LATENCY_BUCKETS)
QUEUE = Histogram("pdserve_queue_seconds", "Arrival until the request is handed to a prefill worker", [MODEL],
                  buckets=LATENCY_BUCKETS)
OUTPUT_TOKENS = Counter("pdserve_output_tokens", "Generated tokens streamed by the gateway", [MODEL])
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of the requests (each choice's) the gateway answered",
                        [MODEL])


class _Sampling(Protocol):
    max_tokens: int
    temperature: float
    top_p: float


class _Request(Protocol):
    """What `describe` reads of a gateway.flow.GenerationRequest (not imported: the flow imports us)."""

    sampling: _Sampling
    messages: Any

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

    def __init__(self, slo: SloMonitor | None, clock=time.perf_counter, request_id: str = "") -> None:
        self._clock = clock
        self._slo = slo
        self.start = clock()
        self.model = ""  # the model_name label: the deployment, once `describe` names it
        self.attributes: dict[str, Any] = {"gen_ai.response.id": request_id} if request_id else {}
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.dispatched_at: float | None = None
        self.output_tokens = 0
        self.input_tokens: int | None = None
        self.finish_reasons: list[str] = []
        self.finished = False

    def describe(self, model: str, request: _Request | None = None, *, operation: str | None = None,
                 response_id: str | None = None) -> None:
        """The request is routed to deployment `model`: its metrics are labelled with it from now on,
        and its span gets the GenAI request attributes of `request` (a GenerationRequest;
        `operation`: "chat" or "text_completion", by default what `request` is; `response_id`: the
        id the client sees, e.g. an OpenAI "chatcmpl-..." one, by default the request id)."""
        self.model = model
        attrs: dict[str, Any] = {"gen_ai.request.model": model}
        if request is not None:
            attrs["gen_ai.operation.name"] = operation or ("chat" if request.messages is not None
                                                           else "text_completion")
            sampling = request.sampling
            attrs.update({"gen_ai.request.max_tokens": sampling.max_tokens,
                          "gen_ai.request.temperature": sampling.temperature,
                          "gen_ai.request.top_p": sampling.top_p})
        elif operation:
            attrs["gen_ai.operation.name"] = operation
        if response_id:
            attrs["gen_ai.response.id"] = response_id
        self.attributes.update(attrs)
        span = _live_span()
        if span is not None:
            span.set_attributes(attrs)

    def dispatched(self) -> None:
        if self.dispatched_at is None:
            self.dispatched_at = self._clock()
            QUEUE.labels(self.model).observe(self.dispatched_at - self.start)

    def output(self, chunk: Any) -> None:
        """One streamed gateway.output.OutputChunk: its tokens (`chunk`), finish reason and usage."""
        self.chunk(len(chunk.token_ids))
        if chunk.finish_reason:
            self.finish_reasons.append(chunk.finish_reason)
        if chunk.usage is not None:  # the last chunk of each choice; n choices of one prompt add up
            self.input_tokens = (self.input_tokens or 0) + chunk.usage.prompt_tokens
            PROMPT_TOKENS.labels(self.model).inc(chunk.usage.prompt_tokens)

    def chunk(self, num_tokens: int) -> None:
        now = self._clock()
        self.last_chunk_at = now
        if not num_tokens:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            ttft = now - self.start
            TTFT.labels(self.model).observe(ttft)
            if self._slo is not None:
                self._slo.observe_ttft(ttft)
        elif self.last_token_at is not None:
            # n tokens arriving together after a gap g: each waited g / n (vllm:inter_token_latency_seconds)
            gap, itl = (now - self.last_token_at) / num_tokens, ITL.labels(self.model)
            for _ in range(num_tokens):
                itl.observe(gap)
        self.last_token_at = now
        self.output_tokens += num_tokens

    def finish(self, status: str) -> None:
        if self.finished:
            return
        self.finished = True
        REQUESTS.labels(status, self.model).inc()
        OUTPUT_TOKENS.labels(self.model).inc(self.output_tokens)
        end = self.last_chunk_at if self.last_chunk_at is not None else self._clock()
        if status == "OK":
            E2E.labels(self.model).observe(end - self.start)
            if self.first_token_at is not None and self.output_tokens > 1:
                TPOT.labels(self.model).observe((end - self.first_token_at) / (self.output_tokens - 1))


def _live_span():
    """The current span when tracing is on and it records, else None (no OpenTelemetry work when off)."""
    if not telemetry.enabled():
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return span if span.is_recording() else None


@contextmanager
def observe_request(request_id: str, session_id: str, slo: SloMonitor | None) -> Iterator[RequestObserver]:
    """Count the request in flight, run the block inside its span (tracing on), record its end.

    The caller reports how the stream ended by letting the exception through (or not)."""
    obs = RequestObserver(slo, request_id=request_id)
    token = _current.set(obs)
    IN_FLIGHT.inc()
    with ExitStack() as stack:
        span = None
        if telemetry.enabled():
            span = stack.enter_context(telemetry.tracer().start_as_current_span(
                "gateway.request", record_exception=False, set_status_on_exception=False,
                attributes={"pdserve.request_id": request_id, "pdserve.session_id": session_id, **obs.attributes}))
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

    parent = telemetry.extract(headers)  # W3C traceparent/tracestate (OTEL_PROPAGATORS), as gRPC's
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
    span.set_attribute("gen_ai.usage.output_tokens", obs.output_tokens)
    if obs.input_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", obs.input_tokens)
    if obs.finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", obs.finish_reasons)
    if obs.first_token_at is not None:
        span.set_attribute("pdserve.ttft_ms", round((obs.first_token_at - obs.start) * 1000, 3))
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, status))
