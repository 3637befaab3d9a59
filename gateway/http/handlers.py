"""The HTTP API's handlers over the gateway's `Catalog` of deployments (the same one the gRPC API uses).

A completion request goes: JSON body -> `ApiRequest` (openai_schema) -> its `model` routed to a
deployment, through an experiment's sticky arm choice when it names one (`Catalog.route`; 404
naming the served models when unknown) -> each prompt tokenized once, checked against that
deployment's context window and vocabulary, the default max_tokens filled in (`_fit`; the flow
takes the ids, `GenerationRequest.prompt_ids`) -> n choices per prompt (`_choices`: seed + i,
one `DecodeAffinity` per prompt), each a `Catalog.run` of its own (the deployment's flow; the
experiment learns the outcome), interleaved by `_run_choices` -> `ChoiceOutput`s (openai_responses). The response names the
public model; `X-Pdserve-Deployment` the deployment. The first chunk is awaited *before* the
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
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from importlib import resources

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from gateway.deadlines import Deadlines
from gateway.deployments import Catalog, Route, UnknownModel
from gateway.flow import DecodeAffinity, GenerationRequest, RequestFlow
from gateway.http.errors import ApiError, api_error_of, json_dumps, public_message
from gateway.http.json_body import read_json_body
from gateway.http.openai_responses import (ChoiceOutput, chunk_json, completion_json, system_fingerprint, total_usage,
                                           usage_chunk_json)
from gateway.http.openai_schema import ApiRequest, parse_chat, parse_completion, with_tools
from gateway.http.tool_calls import delta_json
from gateway.http.sse import SSEWriter
from gateway.observe import RequestObserver, observe_request
from gateway.output import OutputChunk, TokenTexts, Usage
from gateway.request_ids import IDS, RequestIds, new_id, tenant_of
from gateway.request_limits import RequestLimits
from gateway.slo import SloMonitor
from pdserve.grpc_server import ServiceError
from pdserve.runtime.sampling_params import SamplingParams

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
        return await self._complete(request, parse_chat(await read_json_body(request, self.limits.http_body_timeout_s)))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json_body(request, self.limits.http_body_timeout_s)
        return await self._complete(request, parse_completion(body))

    async def _complete(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        """Check the client's ids, hold its request id while the request runs (`_serve`)."""
        api = api.with_client(request.headers.get(REQUEST_ID_HEADER, ""),
                              tenant_of(request.headers.get("Authorization")))
        self.limits.check_ids(api.request)  # ValueError: 400
        with self.ids.claim(api.request.tenant, api.request):  # 409 when in flight
            return await self._serve(request, api)

    async def _serve(self, request: web.Request, api: ApiRequest) -> web.StreamResponse:
        route = self._route(api.model, api.request)
        flow = route.deployment.flow
        # Each prompt is tokenized once, here, and the flow takes the ids; but an experiment may move
        # a request to an arm with another tokenizer before its first token: its flow tokenizes again.
        keep_ids = route.experiment is None
        api = with_tools(api, flow.model.tokenizer)
        fitted = [await self._fit(api, i, req, flow, keep_ids) for i, req in enumerate(api.requests)]
        choices = _choices(api, fitted, flow.model.tokenizer)
        headers = {REQUEST_ID_HEADER: api.request.public_id}
        sse: SSEWriter | None = None
        try:
            # The same request metrics, span and SLO feed as a gRPC request (gateway.observe): the
            # exception leaving this block (or none) is the status it records.
            with observe_request(api.request.public_id, api.request.session_id, self.slo) as obs:
                obs.describe(route.deployment.name, api.request, response_id=api.response_id)
                stream = self._run_choices(route, choices, deadline_in(self.timeout_s), obs)
                async with aclosing(stream):  # however we leave, the flow's downstream calls end
                    first = await anext(stream, None)  # errors up to the first token keep their status
                    if first is None:
                        raise ApiError(500, "the request ended without output", type="server_error")
                    headers[DEPLOYMENT_HEADER] = route.deployment.name  # known once the first token came
                    out = _Response(api, self._fingerprint(route), {c.index: c.output for c in choices})
                    if not api.stream:
                        return await self._whole(out, first, stream, headers)
                    sse = SSEWriter(request, headers)
                    await sse.prepare()
                    await self._send_events(sse, out, first, stream)
            return await sse.done()
        except Exception as exc:  # noqa: BLE001 - re-raised unless the stream has started
            error = self._timed_out(exc) or exc
            if sse is None or not sse.response.prepared:
                raise error from None  # openai_errors answers it with its status
            # 200 is on the wire already: the error is the stream's last event (no [DONE]).
            await sse.send(api_error_of(error).body())
            return sse.response

    @staticmethod
    def _fingerprint(route: Route) -> str:
        return system_fingerprint(route.deployment.name, route.deployment.model.block_names.fingerprint)

    def _timed_out(self, exc: Exception) -> ApiError | None:
        """A 504 naming the HTTP timeout when the flow ran out of this request's time."""
        if not (isinstance(exc, ServiceError) and exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and self.timeout_s):
            return None
        return ApiError(504, f"the request did not finish within the gateway's HTTP timeout of {self.timeout_s:g} s"
                             f" (--http-timeout-s): {public_message(str(exc))}", type="timeout", code="timeout")

    async def _fit(self, api: ApiRequest, index: int, req: GenerationRequest, flow: RequestFlow,
                   keep_ids: bool) -> _Fitted:
        """Prompt `index` tokenized, its token references checked against the vocabulary, and
        max_tokens filled in: what was asked, else all the room the context leaves after the prompt
        (OpenAI's default); 400 when the prompt and max_tokens do not fit."""
        param = api.prompt_param(index)
        try:
            ids = await flow.prompt_ids(req)
        except ValueError as err:
            raise ApiError(400, str(err), param=param,
                           code="context_length_exceeded" if "context window" in str(err) else None) from None
        _check_logit_bias(req.sampling, flow.model.tokenizer.vocab_size)
        window = flow.model.context_window
        room = window - len(ids)
        # The default is capped by the gateway's --max-tokens-limit (request_limits); an explicit value over it fails.
        max_tokens = min(room, flow.limits.max_tokens) if api.max_tokens is None else api.max_tokens
        if room < 1 or max_tokens > room:
            raise _too_long(len(ids), api.max_tokens, window, param)
        sampling = dataclasses.replace(req.sampling, max_tokens=max_tokens)
        prompt_ids = tuple(ids) if keep_ids or req.prompt_ids is not None else None
        return _Fitted(dataclasses.replace(req, sampling=sampling, prompt_ids=prompt_ids), ids)

    async def _run_choices(self, route: Route, choices: list[_Choice], time_remaining: Callable[[], float | None],
                           obs: RequestObserver) -> AsyncIterator[tuple[int, OutputChunk]]:
        """(choice index, chunk) of every choice, interleaved as they come. The first choice of each
        prompt starts at once; its siblings once it has its first token: its prompt's KV then exists
        (in the prefill worker's cache and the kvstore), and its decode worker, which the siblings
        follow (`DecodeAffinity`), has been picked, so they reuse the prompt instead of computing it."""
        if len(choices) == 1:
            async with aclosing(self.catalog.run(route, choices[0].request, time_remaining)) as stream:
                async for chunk in _observed(stream, obs):
                    yield 0, chunk
            return
        queue: asyncio.Queue[tuple[int, OutputChunk | None, Exception | None]] = asyncio.Queue()
        led = {c.group: asyncio.Event() for c in choices}

        async def pump(choice: _Choice) -> None:
            if not choice.leads:
                await led[choice.group].wait()
            try:
                async with aclosing(self.catalog.run(route, choice.request, time_remaining)) as stream:
                    async for chunk in _observed(stream, obs):
                        led[choice.group].set()
                        queue.put_nowait((choice.index, chunk, None))
                queue.put_nowait((choice.index, None, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((choice.index, None, exc))
            finally:
                led[choice.group].set()  # a leader that failed does not hold its siblings forever

        tasks = [asyncio.create_task(pump(c), name=f"choice-{c.index}-{c.request.request_id}") for c in choices]
        try:
            running = len(tasks)
            while running:
                index, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    running -= 1
                else:
                    yield index, chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _whole(self, out: _Response, first: tuple[int, OutputChunk],
                     rest: AsyncIterator[tuple[int, OutputChunk]], headers: dict[str, str]) -> web.Response:
        item: tuple[int, OutputChunk] | None = first
        while item is not None:
            out.choices[item[0]].add(item[1])
            if out.finished:
                return web.json_response(out.completion(), headers=headers, dumps=json_dumps)
            item = await anext(rest, None)
        raise ApiError(500, "the request ended without a finish reason", type="server_error")

    async def _send_events(self, sse: SSEWriter, out: _Response, first: tuple[int, OutputChunk],
                           rest: AsyncIterator[tuple[int, OutputChunk]]) -> None:
        """Per choice: the role (chat) or the echoed prompt, then its text deltas (with their
        tokens' logprobs when asked) and its finish reason; choices interleave as their tokens come.
        Then the usage when asked; not [DONE]."""
        api, model, fp = out.api, out.api.model, out.fingerprint
        for index, choice in sorted(out.choices.items()):
            if api.kind == "chat":
                await sse.send(chunk_json(api, model, fp, index=index, role=True))
            elif choice.echo:
                await sse.send(chunk_json(api, model, fp, index=index, text=choice.echo))
        item: tuple[int, OutputChunk] | None = first
        while item is not None:
            index, chunk = item
            choice = out.choices[index]
            logprobs = choice.add(chunk)
            if choice.parser is not None:  # read for tool calls: content and call deltas as parsed
                for delta in choice.deltas:
                    await sse.send(chunk_json(api, model, fp, index=index, delta=delta_json(delta)))
                if logprobs:
                    await sse.send(chunk_json(api, model, fp, index=index, logprobs=choice.logprobs_json(logprobs)))
            elif chunk.text or logprobs:
                await sse.send(chunk_json(api, model, fp, index=index, text=chunk.text,
                                          logprobs=choice.logprobs_json(logprobs)))
            if chunk.finish_reason:
                await sse.send(chunk_json(api, model, fp, index=index, finish_reason=choice.finish_reason))
            if out.finished:
                if api.include_usage:
                    await sse.send(usage_chunk_json(api, model, fp, out.usage()))
                return
            item = await anext(rest, None)
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
        request_id, score = parse_feedback(await read_json_body(request, self.limits.http_body_timeout_s))
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


@dataclass(frozen=True, slots=True)
class _Fitted:
    """A prompt's request ready for the flow (max_tokens set, token ids attached) and its ids."""

    request: GenerationRequest
    ids: list[int]


@dataclass(frozen=True, slots=True)
class _Choice:
    """One choice of a response: which prompt (`group`) it answers, and the request that makes it."""

    index: int  # OpenAI's choice index: prompt index x n + the choice's number among its prompt's
    group: int
    leads: bool  # its prompt's first choice: the others start once it has its first token
    request: GenerationRequest
    output: ChoiceOutput


def _choices(api: ApiRequest, fitted: list[_Fitted], tokenizer) -> list[_Choice]:
    """n choices per prompt. Each runs as a request of its own (a gateway-unique id; the first keeps
    the prompt's, which an experiment knows), choice i sampling with seed + i so that the choices
    differ and each is reproducible; a prompt's choices share one `DecodeAffinity`."""
    out = []
    for group, fit in enumerate(fitted):
        affinity = DecodeAffinity() if api.n > 1 else None
        echo = (fit.request.prompt or tokenizer.decode(fit.ids)) if api.echo else ""
        for i in range(api.n):
            req, sampling = fit.request, fit.request.sampling
            if i:
                seed = None if sampling.seed is None else sampling.seed + i
                req = dataclasses.replace(req, request_id=new_id(), sampling=dataclasses.replace(sampling, seed=seed))
            req = dataclasses.replace(req, affinity=affinity)
            index = group * api.n + i
            texts = TokenTexts(tokenizer, fit.ids) if api.logprobs is not None else None
            out.append(_Choice(index, group, i == 0, req, ChoiceOutput(api, index, texts, echo)))
    return out


class _Response:
    """The choices of one response as they fill in, and the usage once all have finished."""

    def __init__(self, api: ApiRequest, fingerprint: str, choices: dict[int, ChoiceOutput]) -> None:
        self.api, self.fingerprint, self.choices = api, fingerprint, choices

    @property
    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices.values())

    def usage(self) -> Usage:
        n = self.api.n
        return total_usage([(c.usage, c.index % n == 0) for c in self.choices.values() if c.usage is not None])

    def completion(self) -> dict:
        return completion_json(self.api, self.api.model, self.fingerprint, list(self.choices.values()), self.usage())


def _check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias names token id {bad}, which is not in the model's vocabulary "
                            f"(ids 0 to {vocab_size - 1})", param="logit_bias")


def _too_long(prompt_tokens: int, max_tokens: int | None, window: int, param: str) -> ApiError:
    """The 400 of a prompt and max_tokens over the context window, with the request's own numbers."""
    if max_tokens is None:
        message = (f"the prompt has {prompt_tokens} tokens, which leaves no room for an answer in this model's "
                   f"context window of {window} tokens; shorten the prompt to at most {window - 1} tokens")
    else:
        message = (f"the prompt has {prompt_tokens} tokens and max_tokens asks for {max_tokens} more: "
                   f"{prompt_tokens + max_tokens} tokens, over this model's context window of {window}; ")
        fixes = []
        if prompt_tokens < window:
            fixes.append(f"set max_tokens to at most {window - prompt_tokens}")
        if max_tokens < window:
            fixes.append(f"shorten the prompt to at most {window - max_tokens} tokens")
        message += " or ".join(fixes) or "shorten the prompt and lower max_tokens"
        param = "max_tokens" if prompt_tokens < window else param
    return ApiError(400, message, param=param, code="context_length_exceeded")


async def _observed(stream: AsyncIterator[OutputChunk], obs: RequestObserver) -> AsyncIterator[OutputChunk]:
    """`stream`, telling the observer about each chunk (TTFT, tokens) as it passes."""
    async for chunk in stream:
        obs.output(chunk)
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
