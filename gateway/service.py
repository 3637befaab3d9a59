"""gRPC servicer of pdserve.v1.Gateway: protobuf in, `RequestFlow`, protobuf out.

Both RPCs stream `GenerateResponse` chunks. Errors become statuses through `abort_on`:
ValueError (bad prompt or sampling values) -> INVALID_ARGUMENT, `ServiceError` -> its own code
(RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...), both with a one-line message.

Each stream runs inside `observe.observe_request`: request metrics (TTFT, TPOT, e2e, status, in
flight), the "gateway.request" span when tracing is on, and the TTFT feed of the SLO monitor
(`gateway.slo`), which a background tick re-evaluates every second so a quiet gateway recovers.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import AsyncIterator

import grpc

from gateway.convert import logprob_to_proto, sampling_from_proto
from gateway.flow import GenerationRequest, RequestFlow
from gateway.observe import observe_request
from gateway.output import OutputChunk
from gateway.slo import SloMonitor
from pdserve.grpc_server import abort_on
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def generation_request(msg: gateway_pb2.GenerateRequest | gateway_pb2.ChatRequest) -> GenerationRequest:
    """The protobuf-free request; ValueError on bad sampling values. Generates a request id if empty."""
    request_id = msg.request_id or uuid.uuid4().hex
    sampling = sampling_from_proto(msg.sampling)
    if isinstance(msg, gateway_pb2.ChatRequest):
        messages = tuple({"role": m.role, "content": m.content} for m in msg.messages)
        return GenerationRequest(request_id, sampling, messages=messages, session_id=msg.session_id)
    return GenerationRequest(request_id, sampling, prompt=msg.prompt, session_id=msg.session_id)


def response_of(request_id: str, chunk: OutputChunk) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(
        request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
        logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs], finish_reason=chunk.finish_reason)
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=u.prompt_tokens,
                                            completion_tokens=u.completion_tokens,
                                            cached_tokens=u.cached_tokens))
    return msg


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and Chat by running each request through one RequestFlow."""

    def __init__(self, flow: RequestFlow, slo: SloMonitor | None = None) -> None:
        self.flow = flow
        self.slo = slo or SloMonitor(replicas=lambda: sum(ep.healthy for ep in flow.prefill_pool.endpoints))
        self._slo_task: asyncio.Task | None = None

    @abort_on()
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for msg in self._stream(generation_request(request), context):
            yield msg

    @abort_on()
    async def Chat(self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for msg in self._stream(generation_request(request), context):
            yield msg

    async def _stream(self, request: GenerationRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self._start_slo_tick()
        with observe_request(request.request_id, request.session_id, self.slo) as obs:
            async for chunk in self.flow.run(request, context.time_remaining):
                obs.chunk(len(chunk.token_ids))
                yield response_of(request.request_id, chunk)

    def _start_slo_tick(self) -> None:
        if self._slo_task is None or self._slo_task.done():
            # An empty context: the tick must not inherit this request's span or observer.
            self._slo_task = asyncio.get_running_loop().create_task(
                _tick_forever(self.slo), name="slo-tick", context=contextvars.Context())


async def _tick_forever(slo: SloMonitor, interval_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        slo.evaluate()
