"""OpenAI request JSON -> `ApiRequest` (one `GenerationRequest` per prompt), and `OutputChunk`s ->
OpenAI response JSON.

Parsing checks every field it reads and raises `ApiError` 400 naming the field (`param`), so a
client learns exactly what to fix. Fields that would change the answer but that pdserve cannot
honour (tools, audio, suffix, best_of > 1, ...) are refused rather than silently ignored; fields
that do not change the answer (metadata, store, ...) and unknown ones are ignored, as vLLM does.
docs/http-api.md lists every field with its status.

Beyond OpenAI's own fields: vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`) and its structured-output fields (`guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `structured_outputs`); each structured spec is compiled here by
llguidance (`structured_output.check`), so a spec the workers could not enforce is a 400 naming
its field. `user` becomes the session id (routing affinity).

The responses are built by `gateway.http.openai_responses`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.flow import GenerationRequest
from gateway.http.errors import ApiError
from gateway.http.tools import (ToolRequest, history_message, parse_tools, structured_for, tags_are_tokens,
                                template_tools)
from gateway.request_ids import new_id
from pdserve.runtime.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pdserve.runtime.structured_output import StructuredOutput, check

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 4  # OpenAI's limit
INT32_MAX = 2**31 - 1  # top_k and token ids travel to the workers as protobuf int32
MAX_N = 16  # choices per prompt: each is a sequence on a decode worker, sharing the prompt's blocks
MAX_CHOICES = 64  # prompts x n of one request: each choice holds one of the gateway's in-flight slots
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit; the workers' too)

# Fields pdserve cannot honour: (the values that mean "not used", sent by some SDKs anyway; why not).
_UNSUPPORTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "the deprecated functions field is not supported; send tools"),
    "function_call": ((None, "none", "auto"), "the deprecated function_call field is not supported; send tool_choice"),
    "audio": ((None,), "the served models are text only"),
    "modalities": ((None, ["text"]), "the served models are text only"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "echo": ((None, False), "echo is a /v1/completions field"),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": ((None, ""), "suffix (fill in the middle) is not supported by the served models"),
    "best_of": ((None, 1), "best_of > 1 (server-side ranking of candidates) is not supported; "
                           "ask for n choices with logprobs and rank them yourself"),
}
# The fields that each name what the output must match (one at most per request).
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")

Prompt = str | tuple[int, ...]  # text, or token ids a client sent


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One parsed /v1/chat/completions or /v1/completions request: one GenerationRequest per
    prompt (a chat and most completions have one), each to be answered `n` times."""

    kind: Kind
    model: str
    # Their sampling.max_tokens is a placeholder when max_tokens is None; their seed is choice 0's.
    requests: tuple[GenerationRequest, ...]
    max_tokens: int | None  # None: whatever room the context window leaves after the prompt
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: int | None = None  # alternatives per token (chat top_logprobs, completions logprobs); None: off
    echo: bool = False  # completions: the prompt's text before each choice's text
    tools: ToolRequest | None = None  # chat: the tools the model may call (gateway.http.tools)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request(self) -> GenerationRequest:
        """The first prompt's request: its ids name the whole response."""
        return self.requests[0]

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request.public_id

    def prompt_param(self, index: int = 0) -> str:
        """The field that holds prompt `index`, for errors about it."""
        if self.kind == "chat":
            return "messages"
        return "prompt" if len(self.requests) == 1 else f"prompt[{index}]"

    def with_client(self, client_id: str, tenant: str) -> ApiRequest:
        """Every prompt's request carrying the client's request id (X-Request-Id) and its tenant."""
        return dataclasses.replace(self, requests=tuple(
            dataclasses.replace(r, client_request_id=client_id, tenant=tenant) for r in self.requests))


def parse_chat(body: Any) -> ApiRequest:
    """A /v1/chat/completions body; ApiError 400 naming the bad field."""
    body = _object(body)
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    messages = _messages(body.get("messages"))
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    api = _api_request("chat", body, max_tokens, _chat_logprobs(body), prompts=("",), messages=messages)
    return dataclasses.replace(api, tools=parse_tools(body))


def with_tools(api: ApiRequest, tokenizer: Any) -> ApiRequest:
    """`api` ready for the routed model: its tools rendered by the model's chat template (400 when
    the template has none), and tool_choice "required" or a named function enforced as a grammar
    on the answer (which cannot be combined with another constraint)."""
    if api.tools is None:
        return api
    rendered = template_tools(api.tools, tokenizer.supports_tools)
    constraint = structured_for(api.tools, tags_are_tokens(tokenizer))
    requests = []
    for req in api.requests:
        sampling = req.sampling
        if constraint is not None:
            if sampling.structured is not None:
                raise ApiError(400, 'tool_choice "required" or a named function cannot be combined with '
                                    "response_format or guided_* (both constrain the answer)", param="tool_choice")
            sampling = dataclasses.replace(sampling, structured=constraint)
        requests.append(dataclasses.replace(req, tools=rendered, sampling=sampling))
    return dataclasses.replace(api, requests=tuple(requests))


def parse_completion(body: Any) -> ApiRequest:
    """A /v1/completions body; ApiError 400 naming the bad field."""
    body = _object(body)
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    logprobs = _optional_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = _optional_bool(body, "echo") or False
    if echo and logprobs is not None:
        raise ApiError(400, "echo with logprobs would need the prompt's logprobs, which pdserve's workers do not "
                            "compute; send echo or logprobs, not both", param="echo", code="unsupported_parameter")
    api = _api_request("completion", body, _optional_int(body, "max_tokens", 1), logprobs,
                       prompts=_prompts(body.get("prompt")))
    return dataclasses.replace(api, echo=echo)


def _api_request(kind: Kind, body: Mapping[str, Any], max_tokens: int | None, logprobs: int | None, *,
                 prompts: Sequence[Prompt], messages: tuple[Mapping[str, str], ...] | None = None) -> ApiRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the id of a model from GET /v1/models", param="model")
    n = _optional_int(body, "n", 1, MAX_N) or 1
    if n * len(prompts) > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} make {n * len(prompts)} choices; at most "
                            f"{MAX_CHOICES} per request: send fewer prompts or a smaller n", param="n")
    stream = _optional_bool(body, "stream") or False
    include_usage = _include_usage(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", param="user")
    sampling = _sampling(body, max_tokens or 1, logprobs, n)
    requests = tuple(
        GenerationRequest(new_id(), sampling, prompt=p if isinstance(p, str) else "", messages=messages,
                          session_id=user or "", prompt_ids=None if isinstance(p, str) else p)
        for p in prompts)
    return ApiRequest(kind, model, requests, max_tokens, stream, include_usage, n, logprobs)


def _sampling(body: Mapping[str, Any], max_tokens: int, logprobs: int | None, n: int) -> SamplingParams:
    temperature = _optional_number(body, "temperature", 0.0, 2.0)
    top_p = _optional_number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be greater than 0 and at most 1", param="top_p")
    # vLLM's extra sampling fields, for clients written against it (top_k -1 means off there)
    top_k = _optional_int(body, "top_k", -1, INT32_MAX)
    repetition_penalty = _optional_number(body, "repetition_penalty", 0.0, None)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=_seed(body, n),
            stop=_stop(body.get("stop")),
            top_k=0 if top_k in (None, -1) else top_k,
            min_p=_optional_number(body, "min_p", 0.0, 1.0) or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            ignore_eos=_optional_bool(body, "ignore_eos") or False,
            stop_token_ids=_int_list(body, "stop_token_ids"),
            # The workers send the sampled token's logprob only with at least one alternative:
            # top_logprobs 0 asks for one, and the response leaves it out.
            logprobs=0 if logprobs is None else max(logprobs, 1),
            presence_penalty=_optional_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
            frequency_penalty=_optional_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
            logit_bias=_logit_bias(body.get("logit_bias")),
            structured=_structured(body),
        )
    except ValueError as err:  # a combination SamplingParams refuses; its message names the field
        raise ApiError(400, str(err)) from None


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Alternatives per token of a chat (top_logprobs, 0 by default), None when logprobs is off."""
    wanted = _optional_bool(body, "logprobs") or False
    top = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not wanted:  # 0 without logprobs asks for nothing: some SDKs send it
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; the ids are checked against the vocabulary once the model is known."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, 'logit_bias must be an object of token ids to biases, e.g. {"50256": -100}',
                       param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
            raise ApiError(400, f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                           param="logit_bias")
        if (isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias)
                or not -100 <= bias <= 100):
            raise ApiError(400, f"logit_bias[{key!r}] must be a number from -100 to 100, got {bias!r}",
                           param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


# ---- structured output -----------------------------------------------------------------------

def _structured(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The one spec the output must match, compiled by llguidance; 400 naming the field when it
    does not compile or when two fields ask for one."""
    found = [(name, spec) for name in STRUCTURED_FIELDS
             if body.get(name) is not None and (spec := _structured_field(name, body[name])) is not None]
    if len(found) > 1:
        raise ApiError(400, f"{found[0][0]} and {found[1][0]} both constrain the output; send one of them",
                       param=found[1][0])
    if not found:
        return None
    name, spec = found[0]
    try:
        check(spec)
    except ValueError as err:
        raise ApiError(400, f"{name}: {err}", param=name) from None
    return spec


def _structured_field(name: str, value: Any) -> StructuredOutput | None:
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        return _guided(name.removeprefix("guided_"), value, name)
    except ValueError as err:  # StructuredOutput's own checks (a spec too large)
        raise ApiError(400, f"{name}: {err}", param=name) from None


def _response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise ApiError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                       param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise ApiError(400, "response_format.json_schema must be an object whose schema is a JSON schema object",
                       param="response_format.json_schema")
    for key, kind_ in (("name", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise ApiError(400, f"response_format.json_schema.{key} must be a {kind_.__name__}",
                           param=f"response_format.json_schema.{key}")
    # strict or not, the output is held to the schema: llguidance enforces it token by token
    return StructuredOutput("json_schema", json.dumps(spec.get("schema", {})))


def _structured_outputs(value: Any) -> StructuredOutput | None:
    """Newer vLLM's structured_outputs: one of json, regex, choice, grammar (or json_object: true)."""
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs must be an object with one of json, regex, choice, grammar",
                       param="structured_outputs")
    keys = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object") is True:
        keys.append("json_object")
    if len(keys) != 1:
        raise ApiError(400, f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                            f"json_object; got {keys or 'none'}", param="structured_outputs")
    if keys[0] == "json_object":
        return StructuredOutput("json_object")
    return _guided(keys[0], value[keys[0]], f"structured_outputs.{keys[0]}")


def _guided(kind: str, value: Any, param: str) -> StructuredOutput:
    """vLLM's guided_json (a schema object or its JSON text), guided_regex, guided_choice, guided_grammar."""
    if kind == "json":
        if isinstance(value, dict | bool):
            return StructuredOutput("json_schema", json.dumps(value))
        if isinstance(value, str):
            return StructuredOutput("json_schema", value)
        raise ApiError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ApiError(400, f"{param} must be a non-empty array of strings", param=param)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    return StructuredOutput("regex" if kind == "regex" else "grammar", value)


def _seed(body: Mapping[str, Any], n: int) -> int | None:
    seed = _optional_int(body, "seed", 0)  # the workers take an unsigned 64-bit seed; choice i gets seed + i
    if seed is not None and seed + n - 1 >= 1 << 64:
        raise ApiError(400, f"seed must be below 2**64 - n + 1 (choice i samples with seed + i), got {seed}",
                       param="seed")
    return seed


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ApiError(400, "stream_options.include_usage must be a boolean", param="stream_options.include_usage")
    return value


def _messages(value: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
        if (turn := history_message(m, i)) is not None:  # a tool result, or an assistant's tool calls
            out.append(turn)
            continue
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        out.append({"role": role, "content": _content(m.get("content"), f"messages[{i}].content")})
    return tuple(out)


def _content(value: Any, param: str) -> str:
    """A message's text: a string, or an array of text parts (joined); other parts are refused."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{param}[{j}]: only text content parts are supported, got {kind!r}",
                               param=f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{param} must be a string or an array of text parts", param=param)


def _prompts(value: Any) -> tuple[Prompt, ...]:
    """The prompts of a completions request: a string, token ids, or an array of either (a batch:
    one choice per prompt). Token ids are checked against the vocabulary once the model is known."""
    if isinstance(value, str):
        return (value,)
    if _is_ids(value):
        return (_ids(value, "prompt"),)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    if isinstance(value, list) and value and all(_is_ids(v) for v in value):
        return tuple(_ids(v, f"prompt[{i}]") for i, v in enumerate(value))
    raise ApiError(400, "prompt must be a string, an array of strings, an array of token ids or an array of "
                        "arrays of token ids", param="prompt")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _ids(value: list[int], param: str) -> tuple[int, ...]:
    if not value:
        raise ApiError(400, f"{param} is an empty array of token ids", param=param)
    if not all(0 <= v <= INT32_MAX for v in value):
        raise ApiError(400, f"{param}: token ids must be from 0 to the vocabulary's size", param=param)
    return tuple(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise ApiError(400, f"stop must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them",
                       param="stop")
    return tuple(stops)


def _refuse_unsupported(body: Mapping[str, Any], unsupported: Mapping[str, tuple[tuple[Any, ...], str]]) -> None:
    for name, (unused, why) in unsupported.items():
        value = body.get(name)
        if not any(value == u and type(value) is type(u) for u in unused):
            raise ApiError(400, f"{name} is not supported by pdserve ({why}); leave it out", param=name,
                           code="unsupported_parameter")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _optional_int(body: Mapping[str, Any], name: str, minimum: int | None,
                  maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise ApiError(400, f"{name} must be at most {maximum}, got {value}", param=name)
    return value


def _optional_number(body: Mapping[str, Any], name: str, lo: float, hi: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo:g} and {hi:g}" if hi is not None else f"at least {lo:g}"
        raise ApiError(400, f"{name} must be {bounds}, got {value}", param=name)
    return float(value)


def _optional_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _int_list(body: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              and 0 <= v <= INT32_MAX for v in value):
        raise ApiError(400, f"{name} must be an array of token ids (integers from 0 to {INT32_MAX})", param=name)
    return tuple(value)
