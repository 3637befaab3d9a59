"""The models a gateway serves: named deployments, and experiments that split traffic between them.

A `Deployment` is one model in one format (e.g. `stories-fp32`, `stories-int8`) with its own
`RequestFlow`: its prefill and decode pools and its kvstore client. Deployments never share
workers, and KV never mixes between them: every block hash includes the model's fingerprint
(config + weight files, so an INT8 `pdserve quantize` copy differs from its FP32 source) and the
KV dtype, and `pdserve up --config` gives each deployment its own kvstore process besides.

The `Catalog` maps the public model name of a request to a `Route`:

    model name --(a deployment's name)----------------------------------> that deployment
               --(an experiment's name)--> LiveExperiment.pick(session key) -> the arm's deployment
               --(empty, gRPC only)------> the default model (either of the above)
               --(anything else)---------> UnknownModel (INVALID_ARGUMENT / HTTP 404), naming the served ones

The session key is the request's session_id (the HTTP API puts OpenAI's `user` there); a request
with neither gets a fresh choice. `Catalog.run` streams the route's flow and tells the experiment
how the request went: TTFT, TPOT, or an error on the arm (a client's cancel or bad request teaches
nothing). When an arm fails with UNAVAILABLE before its first token, the request is routed once
more, to whichever arm the experiment picks now that the failed one is marked down; after the
first token an error reaches the client as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from gateway.experiments.live import LiveExperiment, UnknownRequest
from gateway.experiments.policies import NoArmAvailable
from gateway.experiments.report import ArmReport
from gateway.experiments.rewards import Outcome
from gateway.flow import GenerationRequest, ModelInfo, RequestFlow, TimeRemaining
from gateway.output import OutputChunk
from pdserve.grpc_server import ServiceError

log = logging.getLogger(__name__)

# Codes that say the request, not the arm, was at fault: no reward either way.
CLIENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED,
                          grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE})


class UnknownModel(ValueError):
    """A model name the gateway does not serve; the message lists the ones it does."""


@dataclass(eq=False)
class Deployment:
    """One named model deployment and the request flow over its own workers."""

    name: str
    flow: RequestFlow

    @property
    def model(self) -> ModelInfo:
        return self.flow.model

    @property
    def healthy(self) -> bool:
        """True while at least one prefill and one decode worker answer their probes."""
        return (any(ep.healthy for ep in self.flow.prefill_pool.endpoints)
                and any(ep.healthy for ep in self.flow.decode_pool.endpoints))

    def describe(self) -> str:
        return (f"{self.name}: prefill {self.flow.prefill_pool.describe()}; "
                f"decode {self.flow.decode_pool.describe()}")

    async def close(self) -> None:
        await self.flow.prefill_pool.close()
        await self.flow.decode_pool.close()
        if self.flow.kvstore is not None:
            await self.flow.kvstore.close()


@dataclass
class Route:
    """Where one request goes: a deployment, and the experiment that chose it (if one did).
    `Catalog.run` moves it to another arm when it retries there: read `deployment` after the
    first chunk to learn who served the request."""

    deployment: Deployment
    experiment: LiveExperiment | None = None

    @property
    def arm(self) -> str | None:
        return self.deployment.name if self.experiment is not None else None


class StreamTimer:
    """TTFT and TPOT of one request's stream, as the client sees them from the gateway."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_at: float | None = None
        self.tokens = 0

    def chunk(self, tokens: int) -> None:
        if self.first_at is None and tokens:
            self.first_at = time.perf_counter()
        self.tokens += tokens

    def outcome(self) -> Outcome:
        if self.first_at is None:
            return Outcome()
        end = time.perf_counter()
        tpot = (end - self.first_at) / (self.tokens - 1) if self.tokens > 1 else None
        return Outcome(ttft_s=self.first_at - self.start, tpot_s=tpot)


class Catalog:
    """Deployments and experiments by public name; routes requests and joins their feedback."""

    def __init__(self, deployments: Sequence[Deployment], experiments: Sequence[LiveExperiment] = (),
                 default: str | None = None) -> None:
        if not deployments:
            raise ValueError("a gateway needs at least one deployment")
        self.deployments = {d.name: d for d in deployments}
        self.experiments = {e.name: e for e in experiments}
        for exp in experiments:
            missing = [arm for arm in exp.config.arms if arm not in self.deployments]
            if missing:
                raise ValueError(f"experiment {exp.name!r}: no deployment named {missing[0]!r}")
        self.default = default or next(iter(self.experiments), None) or next(iter(self.deployments))
        if self.default not in self.names():
            raise ValueError(f"default model {self.default!r} is neither a deployment nor an experiment")

    def names(self) -> list[str]:
        """Every public model name: experiments first, then deployments."""
        return [*self.experiments, *self.deployments]

    def _is_up(self, arm: str) -> bool:
        return self.deployments[arm].healthy

    # ---- routing -----------------------------------------------------------------------------

    def route(self, model: str, request: GenerationRequest) -> Route:
        """The route of `request` for the public name `model` ("" = the default model)."""
        name = self.check_name(model or self.default)
        if name in self.deployments:
            return Route(self.deployments[name])
        return self._pick(self.experiments[name], request)

    def check_name(self, model: str) -> str:
        """`model` when it is a public name, else UnknownModel naming the ones served."""
        if model not in self.deployments and model not in self.experiments:
            raise UnknownModel(f"the model {model!r} does not exist; this gateway serves "
                               f"{', '.join(repr(n) for n in self.names())}")
        return model

    def _pick(self, exp: LiveExperiment, request: GenerationRequest) -> Route:
        try:
            arm = exp.pick(request.session_id or None, request.request_id, self._is_up)
        except NoArmAvailable:
            detail = "; ".join(self.deployments[a].describe() for a in exp.config.arms)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"every arm of experiment {exp.name!r} is down: {detail}") from None
        return Route(self.deployments[arm], exp)

    async def run(self, route: Route, request: GenerationRequest, time_remaining: TimeRemaining
                  ) -> AsyncIterator[OutputChunk]:
        """Stream `request` through its route's flow, reporting the outcome to its experiment."""
        exp = route.experiment
        if exp is None:
            async with aclosing(route.deployment.flow.run(request, time_remaining)) as stream:
                async for chunk in stream:
                    yield chunk
            return
        timer = StreamTimer()
        try:
            async with aclosing(self._observed(route, request, time_remaining, timer)) as stream:
                async for chunk in stream:
                    yield chunk
        except ServiceError as err:
            if err.code != grpc.StatusCode.UNAVAILABLE or timer.tokens:
                raise
            retry = self._pick(exp, request)  # the failed arm's pools marked its worker down
            if retry.deployment is route.deployment:
                raise
            log.info("request %s: arm %s of %s failed before its first token (%s); retrying on %s",
                     request.request_id, route.arm, exp.name, err, retry.arm)
            route.deployment = retry.deployment
            async with aclosing(self._observed(retry, request, time_remaining, StreamTimer())) as stream:
                async for chunk in stream:
                    yield chunk

    @staticmethod
    async def _observed(route: Route, request: GenerationRequest, time_remaining: TimeRemaining,
                        timer: StreamTimer) -> AsyncIterator[OutputChunk]:
        """The flow's chunks; the experiment learns the outcome exactly once, however it ends."""
        exp, rid = route.experiment, request.request_id
        assert exp is not None
        done = False
        try:
            async with aclosing(route.deployment.flow.run(request, time_remaining)) as stream:
                async for chunk in stream:
                    timer.chunk(len(chunk.token_ids))
                    if chunk.finish_reason:
                        done = True  # before the yield: a consumer may stop reading at the last chunk
                        exp.finished(rid, timer.outcome())
                    yield chunk
        except ServiceError as err:
            if not done:
                if err.code in CLIENT_CODES:
                    exp.abandoned(rid)
                else:
                    exp.finished(rid, Outcome(error=True))
            raise
        except (ValueError, asyncio.CancelledError, GeneratorExit):
            if not done:
                exp.abandoned(rid)
            raise
        except Exception:
            if not done:
                exp.finished(rid, Outcome(error=True))
            raise

    # ---- feedback and report -----------------------------------------------------------------

    def feedback(self, request_id: str, score: float) -> tuple[str, str, float | None]:
        """(experiment, arm, reward now) after joining a client's score to `request_id`.

        ServiceError NOT_FOUND for an unknown or expired id; ValueError for a score out of range."""
        for exp in self.experiments.values():
            if exp.knows(request_id):
                try:
                    arm, value = exp.feedback(request_id, score)
                except UnknownRequest:
                    break
                return exp.name, arm, value
        raise ServiceError(grpc.StatusCode.NOT_FOUND,
                           f"no recent request {request_id!r} served by an experiment; feedback joins by the "
                           f"request_id of a response, within the gateway's table of recent requests")

    def report(self) -> list[ArmReport]:
        """Every arm of every experiment, experiments in configured order."""
        return [row for exp in self.experiments.values() for row in exp.report(self._is_up)]

    async def close(self) -> None:
        for deployment in self.deployments.values():
            await deployment.close()


def as_catalog(source: Catalog | RequestFlow, name: str = "default") -> Catalog:
    """`source` itself, or a catalog of one deployment called `name` over a bare flow."""
    return source if isinstance(source, Catalog) else Catalog([Deployment(name, source)])
