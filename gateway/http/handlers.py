"""The HTTP API's handlers over the gateway's `Catalog` of deployments (the same one the gRPC API uses).

A completion request goes: JSON body -> `ApiRequest` (openai_schema) -> its `model` routed to a
deployment, through an experiment's sticky arm choice when it names one (`Catalog.route`; 404
naming the served models when unknown) -> prompt length checked against that deployment and the
default max_tokens filled in (`_fit`) -> `Catalog.run` (the deployment's flow; the experiment
learns the outcome). The response names the public model; `X-Pdserve-Deployment` the deployment. The first chunk is awaited *before* the
response starts, so every error the flow raises up to the first token (prompt too long, queue
full, no workers) still gets its own HTTP status; after that a stream can only report an error
as an SSE event (`{"error": {...}}`, which OpenAI's SDK raises as APIError).

A client that disconnects cancels its handler (the runner is made with handler_cancellation;
a write to the closed socket is turned into the same CancelledError), which cancels the flow's
downstream call exactly as a gRPC cancel does: the decode worker aborts the sequence and frees its
KV. Each request runs inside `gateway.observe.observe_request`, like a gRPC one, so the request
metrics (pdserve_requests_total{status}, TTFT, TPOT, ...), the request span and the SLO monitor
cover both APIs; a request refused at the HTTP edge (bad field, unknown model, prompt too long)
never reaches the flow and shows only in pdserve_gateway_http_requests_total.

A client may name its request with an `X-Request-Id` header (at most --max-id-chars): it is echoed
in the response's X-Request-Id and id and held per API key while the request runs (another with
the same id: 409, gateway.request_ids); without one the gateway's own id is echoed. A body must
arrive within --http-body-timeout-s (408 otherwise).

Every request has a deadline, --http-timeout-s from its start (gateway.deadlines): the flow gives
each downstream call the time left, and a request that runs out ends with 504 (type "timeout")
naming the flag, or with that error as the stream's last event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from importlib import resources

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gateway.deadlines import Deadlines
from gateway.deployments import Catalog, Route, UnknownModel
from gateway.flow import GenerationRequest, RequestFlow
from gateway.http.errors import ApiError, api_error_of, json_dumps
from gateway.http.openai_schema import (ApiRequest, chunk_json, completion_json, parse_chat, parse_completion,
                                        usage_chunk_json)
from gateway.http.sse import SSEWriter
from gateway.observe import RequestObserver, observe_request
from gateway.output import OutputChunk
from gateway.request_ids import IDS, RequestIds, tenant_of
from gateway.request_limits import RequestLimits
from gateway.slo import SloMonitor
from pdserve.grpc_server import ServiceError

DEPLOYMENT_HEADER = "X-Pdserve-Deployment"  # the deployment (an experiment's arm) that served the request
REQUEST_ID_HEADER = "X-Request-Id"  # the client's id of its request (request), echoed (response)

# The chat page's Content-Security-Policy: everything it needs is inline or from this origin,
# so the browser refuses any third-party fetch (no CDN can sneak in).
PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'")


def deadline_in(seconds: float) -> Callable[[], float | None]:
    """The flow's `time_remaining` for a request that may take `seconds` from now (0: no bound).
    HTTP clients send no deadline; without one a hung worker would hold the request forever."""
    if not seconds:
        return lambda: None
    end = time.monotonic() + seconds
    return lambda: end - time.monotonic()


def load_page() -> bytes:
    """The chat page, shipped as package data beside this module."""
    return resources.files("gateway.http").joinpath("static/index.html").read_bytes()


class ApiHandlers:
    """Serves the OpenAI-compatible endpoints, health, metrics and the chat page."""

    def __init__(self, catalog: Catalog, slo: SloMonitor | None = None, ids: RequestIds = IDS, *,
                 limits: RequestLimits | None = None, deadlines: Deadlines | None = None) -> None:
        self.catalog = catalog
        self.limits = limits or RequestLimits()  # as the app was made with (its body size limit too)
        self.ids = ids
        self.slo = slo  # the gRPC servicer's, so that one SLO window sees both APIs
        # Each request's total bound (--http-timeout-s).
        self.timeout_s = (deadlines or Deadlines()).http_request_s
        self.created = int(time.time())
        self.page = load_page()

    # ---- completions ----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat(await _json_body(request, self.limits.http_body_timeout_s)))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, self.limits.http_body_timeout_s)
        return await self._complete(request, parse_completion(body))

    async def _complete(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        """Check the client's ids, hold its request id while the request runs (`_serve`)."""
        client_id = request.headers.get(REQUEST_ID_HEADER, "")
        api = dataclasses.replace(api, request=dataclasses.replace(api.request, client_request_id=client_id))
        self.limits.check_ids(api.request)  # ValueError: 400
        with self.ids.claim(tenant_of(request.headers.get("Authorization")), api.request):  # 409 when in flight
            return await self._serve(request, api)

    async def _serve(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        route = self._route(api.model, api.request)
        gen = await self._fit(api, route.deployment.flow)
        headers = {REQUEST_ID_HEADER: gen.public_id}
        sse: SSEWriter | None = None
        try:
            # The same request metrics, span and SLO feed as a gRPC request (gateway.observe): the
            # exception leaving this block (or none) is the status it records.
            with observe_request(gen.public_id, gen.session_id, self.slo) as obs:
                stream = self.catalog.run(route, gen, deadline_in(self.timeout_s))
                async with aclosing(stream):  # however we leave, the flow's downstream calls end
                    chunks = _observed(stream, obs)
                    first = await anext(chunks, None)  # errors up to the first token keep their status
                    if first is None:
                        raise ApiError(500, "the request ended without output", type="server_error")
                    headers[DEPLOYMENT_HEADER] = route.deployment.name  # known once the first token came
                    if not api.stream:
                        return await self._whole(api, first, chunks, headers)
                    sse = SSEWriter(request, headers)
                    await sse.prepare()
                    await self._send_events(sse, api, first, chunks)
            return await sse.done()
        except Exception as exc:  # noqa: BLE001 - re-raised unless the stream has started
            error = self._timed_out(exc) or exc
            if sse is None or not sse.response.prepared:
                raise error from None  # openai_errors answers it with its status
            # 200 is on the wire already: the error is the stream's last event (no [DONE]).
            await sse.send(api_error_of(error).body())
            return sse.response

    def _timed_out(self, exc: Exception) -> ApiError | None:
        """A 504 naming the HTTP timeout when the flow ran out of this request's time."""
        if not (isinstance(exc, ServiceError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and self.timeout_s):
            return None
        return ApiError(504, f"the request did not finish within the gateway's HTTP timeout of {self.timeout_s:g} s"
                             f" (--http-timeout-s): {exc}", type="timeout", code="timeout")

    async def _fit(self, api: ApiRequest, flow: RequestFlow) -> GenerationRequest:
        """The request with max_tokens filled in: what was asked, else all the room the context
        leaves after the prompt (OpenAI's default); 400 when the prompt and max_tokens do not fit."""
        req = api.request
        try:
            # With max_tokens=1 the flow's own check fails only for a prompt that alone fills the
            # window; the fit with the real max_tokens is checked below, naming the right field.
            probe = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=1))
            prompt_len = len(await flow.tokenize(probe))
        except ValueError as err:
            raise ApiError(400, str(err), param=api.prompt_param,
                           code="context_length_exceeded" if "context window" in str(err) else None) from None
        window = flow.model.context_window
        room = window - prompt_len
        # The default is capped by the gateway's --max-tokens-limit (request_limits); an explicit value over it fails.
        max_tokens = min(room, flow.limits.max_tokens) if api.max_tokens is None else api.max_tokens
        if max_tokens > room:
            raise ApiError(
                400, f"this model's context window is {window} tokens; the prompt has {prompt_len} and "
                     f"max_tokens asks for {max_tokens} more. Shorten the prompt or set max_tokens to at most {room}",
                param="max_tokens", code="context_length_exceeded")
        return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=max_tokens))

    async def _whole(self, api: ApiRequest, first: OutputChunk, rest: AsyncIterator[OutputChunk],
                     headers: dict[str, str]) -> web.Response:
        texts, last = [first.text], first
        while not last.finish_reason:
            chunk = await anext(rest, None)
            if chunk is None:
                raise ApiError(500, "the request ended without a finish reason", type="server_error")
            texts.append(chunk.text)
            last = chunk
        assert last.usage is not None  # the flow's last chunk always carries it
        body = completion_json(api, api.model, "".join(texts), last.finish_reason, last.usage)
        return web.json_response(body, headers=headers, dumps=json_dumps)

    async def _send_events(self, sse: SSEWriter, api: ApiRequest, first: OutputChunk,
                           rest: AsyncIterator[OutputChunk]) -> None:
        """Role (chat), text deltas, the finish reason, the usage when asked; not [DONE]."""
        if api.kind == "chat":
            await sse.send(chunk_json(api, api.model, role=True))
        chunk: OutputChunk | None = first
        while chunk is not None:
            if chunk.text:
                await sse.send(chunk_json(api, api.model, text=chunk.text))
            if chunk.finish_reason:
                await sse.send(chunk_json(api, api.model, finish_reason=chunk.finish_reason))
                if api.include_usage and chunk.usage is not None:
                    await sse.send(usage_chunk_json(api, api.model, chunk.usage))
                return
            chunk = await anext(rest, None)
        raise ApiError(500, "the request ended without a finish reason", type="server_error")

    def _route(self, model: str, request: GenerationRequest) -> Route:
        try:
            return self.catalog.route(self.catalog.check_name(model), request)  # HTTP has no default model
        except UnknownModel as err:
            raise ApiError(404, str(err), param="model", code="model_not_found") from None

    # ---- models, health, metrics, page -------------------------------------------------------

    def _model_json(self, name: str) -> dict:
        """A deployment as OpenAI lists a model; an experiment also names its arms."""
        body = {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve"}
        exp = self.catalog.experiments.get(name)
        if exp is not None:
            window = min(self.catalog.deployments[a].model.context_window for a in exp.config.arms)
            return {**body, "max_model_len": window, "pdserve_experiment": {"arms": list(exp.config.arms),
                                                                            "policy": exp.config.policy}}
        return {**body, "max_model_len": self.catalog.deployments[name].model.context_window}

    async def models(self, request: web.Request) -> web.Response:
        data = [self._model_json(name) for name in self.catalog.names()]
        return web.json_response({"object": "list", "data": data}, dumps=json_dumps)

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            self.catalog.check_name(name)
        except UnknownModel as err:
            raise ApiError(404, str(err), param="model", code="model_not_found") from None
        return web.json_response(self._model_json(name), dumps=json_dumps)

    async def health(self, request: web.Request) -> web.Response:
        """200 when some deployment has a prefill and a decode worker answering probes, else 503."""
        deployments = list(self.catalog.deployments.values())
        counts = {kind: {"healthy": sum(ep.healthy for d in deployments for ep in _pool(d.flow, kind).endpoints),
                         "total": sum(len(_pool(d.flow, kind).endpoints) for d in deployments)}
                  for kind in ("prefill", "decode")}
        ok = any(d.healthy for d in deployments)
        body: dict = {"status": "ok" if ok else "unavailable", **counts}
        if len(deployments) > 1:
            body["deployments"] = {d.name: "ok" if d.healthy else "unavailable" for d in deployments}
        if not ok:
            body["detail"] = "; ".join(
                f"{d.name + ' ' if len(deployments) > 1 else ''}{kind}: {_pool(d.flow, kind).describe()}"
                for d in deployments for kind in ("prefill", "decode"))
        return web.json_response(body, status=200 if ok else 503, dumps=json_dumps)

    # ---- experiments -------------------------------------------------------------------------

    async def feedback(self, request: web.Request) -> web.Response:
        """POST /v1/feedback {"request_id", "score", "comment"?}: join a client's score to its request."""
        request_id, score = parse_feedback(await _json_body(request, self.limits.http_body_timeout_s))
        gateway_id = self.ids.resolve(tenant_of(request.headers.get("Authorization")), request_id)
        experiment, arm, reward = self.catalog.feedback(gateway_id, score)  # 404 / 400 via openai_errors
        return web.json_response({"request_id": request_id, "experiment": experiment, "arm": arm,
                                  "reward": reward, "pending": reward is None}, dumps=json_dumps)

    async def experiments(self, request: web.Request) -> web.Response:
        """GET /v1/experiments: the per-arm report (`pdserve experiment report` reads it over gRPC)."""
        rows = [dataclasses.asdict(row) for row in self.catalog.report()]
        return web.json_response({"object": "list", "data": rows}, dumps=json_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        # CONTENT_TYPE_LATEST carries parameters (version, charset), which aiohttp's content_type= refuses
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(body=self.page, headers={
            "Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": PAGE_CSP,
            "Cache-Control": "no-cache"})


async def _observed(stream: AsyncIterator[OutputChunk], obs: RequestObserver) -> AsyncIterator[OutputChunk]:
    """`stream`, telling the observer about each chunk (TTFT, tokens) as it passes."""
    async for chunk in stream:
        obs.chunk(len(chunk.token_ids))
        yield chunk


def _pool(flow: RequestFlow, kind: str):
    return flow.prefill_pool if kind == "prefill" else flow.decode_pool


def parse_feedback(body: object) -> tuple[str, float]:
    """(request id, score) of a /v1/feedback body; ApiError 400 naming the bad field. OpenAI-style
    response ids ("chatcmpl-<id>", "cmpl-<id>") are accepted as the request id they carry."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object with request_id and score")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ApiError(400, "request_id is required: the X-Request-Id header (or id) of the response being scored",
                       param="request_id")
    score = body.get("score")
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise ApiError(400, f"score must be a number, got {score!r}", param="score")
    comment = body.get("comment")
    if comment is not None and not isinstance(comment, str):
        raise ApiError(400, "comment must be a string", param="comment")
    for prefix in ("chatcmpl-", "cmpl-"):
        request_id = request_id.removeprefix(prefix)
    return request_id, float(score)


async def _json_body(request: web.Request, timeout_s: float) -> object:
    try:
        async with asyncio.timeout(timeout_s):  # a client trickling its body must not hold a handler
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                            "(--http-body-timeout-s); send it at once", headers={"Connection": "close"}) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ApiError(400, "the request body is JSON nested too deeply to parse") from None
