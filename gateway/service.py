"""gRPC servicer of pdserve.v1.Gateway: protobuf in, `Catalog` (route, `RequestFlow`), protobuf out.

Generate and Chat stream `GenerateResponse` chunks; the request's `model` names a deployment or an
experiment (`gateway.deployments`), empty means the gateway's default, and every chunk names the
deployment that served it. Feedback joins a client's score to a recent request of an experiment;
ExperimentReport returns every arm's statistics (`pdserve experiment report`). Errors become statuses through `abort_on`:
ValueError (bad prompt or sampling values) -> INVALID_ARGUMENT, `ServiceError` -> its own code
(RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...), both with a one-line message.

Each stream runs inside `observe.observe_request`: request metrics (TTFT, TPOT, e2e, status, in
flight), the "gateway.request" span when tracing is on, and the TTFT feed of the SLO monitor
(`gateway.slo`), which a background tick re-evaluates every second so a quiet gateway recovers.

Request ids (`gateway.request_ids`): every request runs under a gateway-unique id; a client's
request_id (at most --max-id-chars, as session_id) is echoed in every chunk and held per API key
while it runs, so a second call with it gets ALREADY_EXISTS at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from gateway.config import GatewayConfig
from gateway.deployments import Catalog, as_catalog
from gateway.experiments.report import ArmReport
from gateway.flow import GenerationRequest, RequestFlow
from gateway.observe import observe_request
from gateway.output import OutputChunk
from gateway.request_ids import IDS, RequestIds, new_id, tenant_of
from gateway.slo import SloMonitor
from pdserve import log_privacy
from gateway.redact import public_message
from pdserve.grpc_server import abort_on
from pdserve.interceptors import metadata_value
from pdserve.proto_convert import logprob_to_proto, sampling_from_proto
from pdserve.runtime.structured_output import check as check_structured
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def generation_request(msg: gateway_pb2.GenerateRequest | gateway_pb2.ChatRequest) -> GenerationRequest:
    """The protobuf-free request under a new gateway id (the client's kept as client_request_id);
    ValueError on bad sampling values, or a structured output spec llguidance cannot compile (its
    message says why; checked once per distinct spec, before any worker sees the request)."""
    sampling = sampling_from_proto(msg.sampling)
    if sampling.structured is not None:
        check_structured(sampling.structured)
    ids = {"session_id": msg.session_id, "client_request_id": msg.request_id}
    if isinstance(msg, gateway_pb2.ChatRequest):
        messages = tuple({"role": m.role, "content": m.content} for m in msg.messages)
        return GenerationRequest(new_id(), sampling, messages=messages, **ids)
    return GenerationRequest(new_id(), sampling, prompt=msg.prompt, **ids)


def tenant_of_call(context: grpc.aio.ServicerContext) -> str:
    """The call's tenant (its API key; "" without one): the scope of its request ids."""
    return tenant_of(metadata_value(context.invocation_metadata(), "authorization"))


def response_of(request_id: str, chunk: OutputChunk, deployment: str = "") -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(
        request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
        logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs], finish_reason=chunk.finish_reason,
        deployment=deployment)
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=u.prompt_tokens,
                                            completion_tokens=u.completion_tokens,
                                            cached_tokens=u.cached_tokens))
    return msg


def arm_report_to_proto(row: ArmReport) -> gateway_pb2.ArmReport:
    return gateway_pb2.ArmReport(**dataclasses.asdict(row))


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and Chat by routing each request (`Catalog`) through a deployment's RequestFlow."""

    def __init__(self, catalog: Catalog | RequestFlow, slo: SloMonitor | None = None,
                 ids: RequestIds = IDS, settings: GatewayConfig | None = None) -> None:
        catalog = self.catalog = as_catalog(catalog)  # a bare flow: one deployment, the default
        self.settings = settings or GatewayConfig()  # the gateway's (gateway.server); defaults in tests
        self.limits = self.settings.limits  # the edge's: ids are checked before any routing
        self.ids = ids
        pools = [d.flow.prefill_pool for d in catalog.deployments.values()]
        self.slo = slo or SloMonitor(self.settings.slo,
                                     replicas=lambda: sum(ep.healthy for p in pools for ep in p.endpoints))
        self._slo_task: asyncio.Task | None = None

    @abort_on(public=public_message)
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for msg in self._stream(generation_request(request), context, request.model):
            yield msg

    @abort_on(public=public_message)
    async def Chat(self, request: gateway_pb2.ChatRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async for msg in self._stream(generation_request(request), context, request.model):
            yield msg

    @abort_on(public=public_message)
    async def Feedback(self, request: gateway_pb2.FeedbackRequest, context: grpc.aio.ServicerContext
                       ) -> gateway_pb2.FeedbackResponse:
        if not request.request_id:
            raise ValueError("request_id is required: the request_id of the response being scored")
        gateway_id = self.ids.resolve(tenant_of_call(context), request.request_id)
        experiment, arm, reward = self.catalog.feedback(gateway_id, request.score)
        if request.comment:
            log.info("feedback on %s (%s/%s) %g: %s", request.request_id, experiment, arm, request.score,
                     log_privacy.content(request.comment, self.settings.log_prompts))  # user text: hidden unless asked
        return gateway_pb2.FeedbackResponse(experiment=experiment, arm=arm, reward=reward or 0.0,
                                            pending=reward is None)

    @abort_on(public=public_message)
    async def ExperimentReport(self, request: gateway_pb2.ExperimentReportRequest,
                               context: grpc.aio.ServicerContext) -> gateway_pb2.ExperimentReportResponse:
        return gateway_pb2.ExperimentReportResponse(arms=[arm_report_to_proto(r) for r in self.catalog.report()])

    async def _stream(self, request: GenerationRequest, context: grpc.aio.ServicerContext, model: str = ""
                      ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self._start_slo_tick()
        self.limits.check_ids(request)
        request = dataclasses.replace(request, tenant=tenant_of_call(context))
        with self.ids.claim(request.tenant, request), \
                observe_request(request.public_id, request.session_id, self.slo) as obs:
            route = self.catalog.route(model, request)
            obs.describe(route.deployment.name, request)
            async with aclosing(self.catalog.run(route, request, context.time_remaining)) as stream:
                async for chunk in stream:
                    obs.output(chunk)
                    yield response_of(request.public_id, chunk, route.deployment.name)

    def _start_slo_tick(self) -> None:
        if self._slo_task is None or self._slo_task.done():
            # An empty context: the tick must not inherit this request's span or observer.
            self._slo_task = asyncio.get_running_loop().create_task(
                _tick_forever(self.slo), name="slo-tick", context=contextvars.Context())


async def _tick_forever(slo: SloMonitor, interval_s: float = 1.0) -> None:
    while True:
        await asyncio.sleep(interval_s)
        slo.evaluate()
