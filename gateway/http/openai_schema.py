"""OpenAI request JSON -> `GenerationRequest`, and `OutputChunk`s -> OpenAI response JSON.

Parsing checks every field it reads and raises `ApiError` 400 naming the field (`param`), so a
client learns exactly what to fix. Fields that would change the answer but that pdserve cannot
honour (n > 1, tools, logprobs, penalties, ...) are refused rather than silently ignored; fields
that do not change the answer (metadata, store, ...) and unknown ones are ignored, as vLLM does.
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`) are accepted too. `user` becomes the session id (routing affinity).

Response builders produce exactly OpenAI's shapes: `chat.completion` / `text_completion`
objects, and for streams `chat.completion.chunk` / `text_completion` chunks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.flow import GenerationRequest
from gateway.http.errors import ApiError
from gateway.output import Usage
from gateway.request_ids import new_id
from pdserve.runtime.sampling_params import SamplingParams

Kind = Literal["chat", "completion"]
MAX_STOP_STRINGS = 4  # OpenAI's limit
INT32_MAX = 2**31 - 1  # top_k and token ids travel to the workers as protobuf int32

# Fields pdserve cannot honour, with the values that mean "not used" (sent by some SDKs anyway).
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "logprobs": (None, False), "top_logprobs": (None, 0),
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, 0), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """One parsed /v1/chat/completions or /v1/completions request."""

    kind: Kind
    model: str
    request: GenerationRequest  # its sampling.max_tokens is a placeholder when max_tokens is None
    max_tokens: int | None  # None: whatever room the context window leaves after the prompt
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request.public_id

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt, for errors about it."""
        return "messages" if self.kind == "chat" else "prompt"


def parse_chat(body: Any) -> ApiRequest:
    """A /v1/chat/completions body; ApiError 400 naming the bad field."""
    body = _object(body)
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    messages = _messages(body.get("messages"))
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    return _api_request("chat", body, max_tokens, messages=messages)


def parse_completion(body: Any) -> ApiRequest:
    """A /v1/completions body; ApiError 400 naming the bad field."""
    body = _object(body)
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    return _api_request("completion", body, _optional_int(body, "max_tokens", 1), prompt=_prompt(body.get("prompt")))


def _api_request(kind: Kind, body: Mapping[str, Any], max_tokens: int | None, *, prompt: str = "",
                 messages: tuple[Mapping[str, str], ...] | None = None) -> ApiRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the id of a model from GET /v1/models", param="model")
    n = _optional_int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, f"n must be 1 (pdserve returns one choice per request), got {n}", param="n")
    stream = _optional_bool(body, "stream") or False
    include_usage = _include_usage(body.get("stream_options"), stream)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", param="user")
    sampling = _sampling(body, max_tokens or 1)
    request = GenerationRequest(new_id(), sampling, prompt=prompt, messages=messages,
                                session_id=user or "")
    return ApiRequest(kind, model, request, max_tokens, stream, include_usage)


def _sampling(body: Mapping[str, Any], max_tokens: int) -> SamplingParams:
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
            seed=_seed(body),
            stop=_stop(body.get("stop")),
            top_k=0 if top_k in (None, -1) else top_k,
            min_p=_optional_number(body, "min_p", 0.0, 1.0) or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            ignore_eos=_optional_bool(body, "ignore_eos") or False,
            stop_token_ids=_int_list(body, "stop_token_ids"),
        )
    except ValueError as err:  # a combination SamplingParams refuses; its message names the field
        raise ApiError(400, str(err)) from None


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _optional_int(body, "seed", 0)  # the workers take an unsigned 64-bit seed
    if seed is not None and seed >= 1 << 64:
        raise ApiError(400, f"seed must be below 2**64, got {seed}", param="seed")
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


def _messages(value: Any) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
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


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one is a prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise ApiError(400, f"prompt has {len(value)} prompts; send one prompt per request", param="prompt")
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        raise ApiError(400, "prompt as token ids is not supported; send text", param="prompt")
    raise ApiError(400, "prompt must be a string", param="prompt")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > MAX_STOP_STRINGS):
        raise ApiError(400, f"stop must be a non-empty string or an array of up to {MAX_STOP_STRINGS} of them",
                       param="stop")
    return tuple(stops)


def _refuse_unsupported(body: Mapping[str, Any], unsupported: Mapping[str, tuple[Any, ...]]) -> None:
    for name, unused in unsupported.items():
        value = body.get(name)
        if not any(value == u and type(value) is type(u) for u in unused):
            raise ApiError(400, f"{name} is not supported by pdserve; leave it out", param=name,
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


# ---- responses -------------------------------------------------------------------------------

def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason_json(reason: str) -> str:
    # The flow's "abort" (ended without a worker's reason) has no OpenAI name; the text did stop.
    return reason if reason in ("stop", "length") else "stop"


def completion_json(api: ApiRequest, model: str, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    """The whole (non-streamed) chat.completion or text_completion object."""
    reason = finish_reason_json(finish_reason)
    if api.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return {"id": api.response_id, "object": obj, "created": api.created, "model": model,
            "choices": [choice], "usage": usage_json(usage)}


def chunk_json(api: ApiRequest, model: str, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk with one choice: the role (chat), a text delta, or the finish reason."""
    reason = finish_reason_json(finish_reason) if finish_reason else None
    if api.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return _chunk_envelope(api, model, [choice], None)


def usage_chunk_json(api: ApiRequest, model: str, usage: Usage) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, the usage."""
    return _chunk_envelope(api, model, [], usage_json(usage))


def _chunk_envelope(api: ApiRequest, model: str, choices: Sequence[dict[str, Any]],
                    usage: dict[str, Any] | None) -> dict[str, Any]:
    obj = "chat.completion.chunk" if api.kind == "chat" else "text_completion"
    out: dict[str, Any] = {"id": api.response_id, "object": obj, "created": api.created, "model": model,
                           "choices": list(choices)}
    if api.include_usage:
        out["usage"] = usage  # null on every chunk but the last, as OpenAI does
    return out
