"""Tool calling (function calling) for /v1/chat/completions, as OpenAI, vLLM and SGLang serve it.

The path of a request with tools, and who owns each piece:

    body.tools / tool_choice / parallel_tool_calls ── parse_tools ──▶ ToolRequest     (400 names the field)
    body.messages[i] (role "tool", assistant "tool_calls") ── history_message ──▶ plain dicts
         (arguments parsed from their JSON string: templates write them with `tojson`)
    the routed model's tokenizer ── template_tools ──▶ the tools its template renders, or 400
         when it has no tool support (tool_choice "none" is accepted there: nothing is parsed)
    tool_choice "required" / a named function ── structured_for ──▶ StructuredOutput (grammar)
         that the engine enforces: exactly the format the parser reads
    the model's text ── tool_calls.ToolCallParser.feed (deltas) / finish ──▶ content + message.tool_calls

The format parsed is Hermes' and Qwen2.5's (their templates tell the model to answer so):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one or several, with text before, between or after them (the message's content). A call's
`arguments` is the JSON text the model wrote (OpenAI's contract: clients parse it), streamed as it
is generated once `{"name": "...", "arguments": ` is read. A call written otherwise (keys in
another order, no arguments) is read when its closing tag arrives; a call whose body is not such
JSON stays in the content as text; a call cut off by max_tokens keeps the arguments it got (the
finish reason stays "length").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.http.errors import ApiError
from gateway.http.tool_calls import CLOSE, OPEN
from pdserve.runtime.structured_output import StructuredOutput, check

MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
Choice = Literal["none", "auto", "required", "function"]
# JSON in a forced call is laid out as json.dumps lays it out (what the templates show the model);
# flexible whitespace lets a small model write newlines forever inside a valid object.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools and what it asks of them."""

    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects as the client sent them (validated)
    choice: Choice = "auto"
    function: str | None = None  # the function tool_choice names (choice "function")
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the answer is read for tool calls (not under tool_choice "none")."""
        return self.choice != "none"


# ---- request -------------------------------------------------------------------------------

def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The body's tools, tool_choice and parallel_tool_calls; None without tools. ApiError 400
    naming the field (`tools[2].function.name`, `tool_choice.function.name`, ...)."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    choice, function = _tool_choice(body.get("tool_choice"), tools)
    return ToolRequest(tools, choice, function, parallel) if tools else None


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ApiError(400, "tools must be an array of {type: \"function\", function: {...}} objects", param="tools")
    if len(value) > MAX_TOOLS:
        raise ApiError(400, f"tools has {len(value)} tools; at most {MAX_TOOLS}", param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        name = _tool(tool, f"tools[{i}]")
        if name in seen:
            raise ApiError(400, f"tools[{i}].function.name {name!r} names an earlier tool too; names must be unique",
                           param=f"tools[{i}].function.name")
        seen.add(name)
    return tuple(value)


def _tool(tool: Any, param: str) -> str:
    """Check one tool object; its function's name."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    if tool.get("type") != "function":
        raise ApiError(400, f"{param}.type must be \"function\" (the only tool type pdserve serves), "
                            f"got {tool.get('type')!r}", param=f"{param}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{param}.function must be an object with a name", param=f"{param}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApiError(400, f"{param}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                            f"got {name!r}", param=f"{param}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise ApiError(400, f"{param}.function.description must be a string", param=f"{param}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise ApiError(400, f"{param}.function.parameters must be a JSON schema object",
                       param=f"{param}.function.parameters")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise ApiError(400, f"{param}.function.strict must be true or false", param=f"{param}.function.strict")
    return name


def _tool_choice(value: Any, tools: Sequence[Mapping[str, Any]]) -> tuple[Choice, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto"):
        return value, None
    if value == "required" or isinstance(value, dict):
        if not tools:
            raise ApiError(400, "tool_choice requires tools: send the tools the model may call", param="tool_choice")
        if value == "required":
            return "required", None
        return "function", _named_choice(value, tools)
    raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                        f'"function": {{"name": ...}}}}, got {value!r}', param="tool_choice")


def _named_choice(value: Mapping[str, Any], tools: Sequence[Mapping[str, Any]]) -> str:
    if value.get("type") != "function":
        raise ApiError(400, f'tool_choice.type must be "function", got {value.get("type")!r}', param="tool_choice.type")
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice.function.name must name one of the tools", param="tool_choice.function.name")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ApiError(400, f"tool_choice.function.name {name!r} is not one of the tools ({', '.join(names)})",
                       param="tool_choice.function.name")
    return name


def history_message(message: Mapping[str, Any], i: int) -> dict[str, Any] | None:
    """`messages[i]` as the chat template takes it when it belongs to a tool conversation (role
    "tool", or an assistant message with tool_calls); None for any other message. ApiError 400
    naming the field."""
    role = message.get("role")
    if role == "tool":
        return _tool_result(message, f"messages[{i}]")
    calls = message.get("tool_calls")
    if role == "assistant" and calls is not None and calls != []:
        return _assistant_calls(message, calls, f"messages[{i}]")
    return None


def _tool_result(message: Mapping[str, Any], param: str) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(400, f"{param}.tool_call_id is required: the id of the tool call this message answers",
                       param=f"{param}.tool_call_id")
    out = {"role": "tool", "tool_call_id": call_id, "content": _text(message.get("content"), f"{param}.content")}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]  # some templates write the function's name beside its result
    return out


def _assistant_calls(message: Mapping[str, Any], calls: Any, param: str) -> dict[str, Any]:
    if not isinstance(calls, list):
        raise ApiError(400, f"{param}.tool_calls must be an array of tool calls", param=f"{param}.tool_calls")
    out: dict[str, Any] = {"role": "assistant"}
    if message.get("content") is not None:  # null beside tool calls, as OpenAI's SDK sends it: left out
        out["content"] = _text(message["content"], f"{param}.content")
    out["tool_calls"] = [_history_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)]
    return out


def _history_call(call: Any, param: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ApiError(400, f"{param}.id must be the call's id (a string)", param=f"{param}.id")
    if call.get("type", "function") != "function":
        raise ApiError(400, f'{param}.type must be "function", got {call.get("type")!r}', param=f"{param}.type")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, f"{param}.function must be an object with a name", param=f"{param}.function")
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": _history_arguments(fn.get("arguments"), param)}}


def _history_arguments(value: Any, param: str) -> dict[str, Any]:
    """A past call's arguments as an object: templates write them with `tojson`, which would
    quote OpenAI's JSON string a second time (vLLM parses them so too)."""
    param = f"{param}.function.arguments"
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value or "{}")
        except json.JSONDecodeError as err:
            raise ApiError(400, f"{param} is not valid JSON: {err}", param=param) from None
        if isinstance(parsed, dict):
            return parsed
    raise ApiError(400, f"{param} must be a JSON object (as a string)", param=param)


def _text(value: Any, param: str) -> str:
    """A message's text: a string, or an array of text parts (joined)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ApiError(400, f"{param} must be a string or an array of text parts", param=param)


def template_tools(request: ToolRequest | None, supports_tools: bool) -> tuple[dict[str, Any], ...] | None:
    """The tools to render into the prompt. A template without tool support (it never reads
    `tools`) cannot tell the model about them: 400, except under tool_choice "none", where
    nothing is parsed and the tools are simply left out (vLLM accepts "none" whatever the
    template; it does render the tools into a template that supports them, as this does)."""
    if request is None:
        return None
    if supports_tools:
        return request.tools
    if request.choice == "none":
        return None
    raise ApiError(400, "the model's chat template has no tool support (it does not render `tools`); "
                        "leave tools out, or serve a model whose template has them", param="tools",
                   code="tools_not_supported")


# ---- constrained calls ------------------------------------------------------------------------

def structured_for(request: ToolRequest, tag_tokens: bool = False) -> StructuredOutput | None:
    """The constraint that makes tool_choice "required" (one or more calls of listed tools; one
    when parallel_tool_calls is false) or a named function (one call of it) hold: a Lark grammar
    of exactly the parsed format, with each tool's parameters as an embedded JSON schema. None
    for "auto" and "none" (the model chooses). `tag_tokens`: the vocabulary has <tool_call> and
    </tool_call> as added tokens (`tags_are_tokens`); llguidance matches added tokens only by
    token, never as text. ApiError 400 naming the tool whose parameters llguidance refuses."""
    if request.choice not in ("required", "function"):
        return None
    picked = [(i, t) for i, t in enumerate(request.tools)
              if request.choice == "required" or t["function"]["name"] == request.function]
    for i, tool in picked:
        _check_parameters(_arguments_schema(tool), f"tools[{i}].function.parameters")
    try:
        so = StructuredOutput("grammar", _calls_grammar([t for _, t in picked], tag_tokens,
                                                        request.parallel and request.choice == "required"))
        check(so)
    except ValueError as err:
        raise ApiError(400, f"the tools cannot be enforced for tool_choice: {err}", param="tools") from None
    return so


def tags_are_tokens(tokenizer: Any) -> bool:
    """Whether <tool_call> and </tool_call> are each one token of `tokenizer` (Qwen2.5, Hermes:
    added tokens), which the grammar must then name as tokens."""
    return all(len(tokenizer.encode(tag, add_bos=False)) == 1 for tag in (OPEN, CLOSE))


def _arguments_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    # No parameters: OpenAI's "function with an empty parameter list".
    schema = tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}


def _check_parameters(schema: dict[str, Any], param: str) -> None:
    try:
        check(StructuredOutput("json_schema", json.dumps(schema)))
    except ValueError as err:
        raise ApiError(400, f"{param} cannot be enforced as a JSON schema: {err}", param=param) from None


def _calls_grammar(tools: Sequence[Mapping[str, Any]], tag_tokens: bool, many: bool) -> str:
    """`<tool_call>\\n{"name": "<name>", "arguments": <parameters>}\\n</tool_call>`, once, or
    one or more times separated by a newline (as Qwen2.5's template writes several)."""
    open_tag, close_tag = (OPEN, CLOSE) if tag_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    lines = ['start: call ("\\n" call)*' if many else "start: call",
             "call: " + " | ".join(f"call_{k}" for k in range(len(tools)))]
    for k, tool in enumerate(tools):
        head = json.dumps('\n{"name": "' + tool["function"]["name"] + '", "arguments": ')
        lines.append(f'call_{k}: {open_tag} {head} args_{k} "}}\\n" {close_tag}')
        lines.append(f"args_{k}: %json {json.dumps(_arguments_schema(tool))}")
    return "\n".join(lines) + "\n"
