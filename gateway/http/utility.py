"""The HTTP API's utility endpoints, shaped as vLLM's: /tokenize, /detokenize, /version.

    POST /tokenize    {"model", "prompt", "add_special_tokens"?: true}
                      {"model", "messages", "add_generation_prompt"?: true}
                      -> {"count", "max_model_len", "tokens": [...]}
    POST /detokenize  {"model", "tokens": [...]} -> {"prompt": text}
    GET  /version     -> {"version": pdserve's version}

A prompt or a chat is tokenized exactly as a completion request's is (the deployment's tokenizer,
`gateway.prompts.encode_off_loop`, the chat parsed by the completions' own parser), so `count` is
the `usage.prompt_tokens` the same request gets. `max_model_len` is the context window the gateway
admits (the model's, or --max-model-len). Unlike a completion, a prompt longer than the window is
counted, not refused (vLLM does the same: counting is what /tokenize is for); the character bound
of --max-prompt-tokens x --max-chars-per-token still applies, so one request cannot tie the
tokenizer up. `model` names a deployment or an experiment (then its first arm's tokenizer); left
out, the gateway's default model. These endpoints sit behind the same API keys as /v1.
"""

from __future__ import annotations

import asyncio
import functools
from importlib import metadata
from typing import Any

from aiohttp import web

import pdserve
from gateway.deployments import Catalog, Deployment, UnknownModel
from gateway.http.errors import ApiError, json_dumps
from gateway.http.json_body import read_json_body
from gateway.http.openai_schema import parse_chat, parse_completion, with_tools
from gateway.prompts import INLINE_CHARS, encode_off_loop, prompt_chars
from gateway.request_limits import RequestLimits


def pdserve_version() -> str:
    """The installed package's version, else the source tree's."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return pdserve.__version__


class UtilityHandlers:
    """The utility endpoints over the same `Catalog` as the completions."""

    def __init__(self, catalog: Catalog, limits: RequestLimits | None = None) -> None:
        self.catalog = catalog
        self.limits = limits or RequestLimits()
        self.version = pdserve_version()

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request, self.limits.http_body_timeout_s)
        deployment = self._deployment(body)
        flow = deployment.flow
        prompt, messages, tools = _prompt_or_chat(body, deployment.name, flow.model.tokenizer)
        window = flow.model.context_window
        self.limits.check_chars(prompt_chars(prompt, messages, tools), window)  # ValueError: 400
        if messages is None and not _bool(body, "add_special_tokens", True):
            # Off the loop when long, as encode_off_loop does (check_chars bounded the work).
            encode = functools.partial(flow.model.tokenizer.encode, prompt, add_bos=False)
            ids = encode() if len(prompt) <= INLINE_CHARS else await asyncio.to_thread(encode)
        else:
            ids = await encode_off_loop(flow.model.tokenizer, prompt, messages, tools)
        return web.json_response({"count": len(ids), "max_model_len": window, "tokens": ids}, dumps=json_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request, self.limits.http_body_timeout_s)
        deployment = self._deployment(body)
        model = deployment.model
        ids = _token_ids(body.get("tokens"), model.tokenizer.vocab_size, model.context_window)
        # vLLM's detokenize keeps special tokens (transformers' decode default): a round trip shows them.
        return web.json_response({"prompt": model.tokenizer.decode(ids, skip_special=False)}, dumps=json_dumps)

    async def version_info(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version}, dumps=json_dumps)

    def _deployment(self, body: dict[str, Any]) -> Deployment:
        """The deployment whose tokenizer serves `body["model"]` (default: the gateway's default model)."""
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ApiError(400, "model must be the id of a model from GET /v1/models", param="model")
        try:
            name = self.catalog.check_name(model or self.catalog.default)
        except UnknownModel as err:
            raise ApiError(404, str(err), param="model", code="model_not_found") from None
        experiment = self.catalog.experiments.get(name)
        return self.catalog.deployments[experiment.config.arms[0] if experiment is not None else name]


def _prompt_or_chat(body: dict[str, Any], model: str, tokenizer: Any) -> tuple[str, tuple | None, tuple | None]:
    """(prompt, None, None) or ("", messages, tools) of a /tokenize body, parsed as the completions
    parse them (the tools as the model's template renders them)."""
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "send either prompt (a text) or messages (a chat), not both or neither",
                       param="prompt" if "prompt" in body else "messages")
    if "prompt" in body:
        if body["prompt"] == "":
            raise ApiError(400, "prompt is empty", param="prompt")
        api = parse_completion({"model": model, "prompt": body["prompt"]})
        if len(api.requests) != 1 or api.request.prompt_ids is not None:
            raise ApiError(400, "prompt must be one text for /tokenize", param="prompt")
        return api.request.prompt, None, None
    if not _bool(body, "add_generation_prompt", True):
        # The chat template is rendered as the completions render it: with the assistant's turn opened.
        raise ApiError(400, "add_generation_prompt=false is not supported: pdserve renders a chat with the "
                            "assistant's turn opened, as a completion request does", param="add_generation_prompt")
    if _bool(body, "add_special_tokens", False):
        raise ApiError(400, "add_special_tokens=true is not supported for messages: the chat template writes "
                            "the special tokens itself", param="add_special_tokens")
    chat = {"model": model, "messages": body["messages"], **{k: body[k] for k in ("tools", "tool_choice") if k in body}}
    request = with_tools(parse_chat(chat), tokenizer).request
    return "", request.messages, request.tools


def _token_ids(value: Any, vocab_size: int, most: int) -> list[int]:
    """The ids of a /detokenize body; 400 naming the first one outside the vocabulary."""
    if not isinstance(value, list):
        raise ApiError(400, "tokens must be an array of token ids", param="tokens")
    if len(value) > most:
        raise ApiError(400, f"tokens has {len(value)} ids, more than the model's context window of {most}",
                       param="tokens")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ApiError(400, f"tokens[{i}] = {t!r} is not a token id of this model's vocabulary "
                                f"(0..{vocab_size - 1})", param=f"tokens[{i}]")
    return value


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return value


async def _json_object(request: web.Request, timeout_s: float) -> dict[str, Any]:
    """The JSON object of the body, read as a completion's is (--http-body-timeout-s, 413)."""
    body = await read_json_body(request, timeout_s)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body
