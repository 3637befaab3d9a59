"""Tool calling (function calling) for /v1/chat/completions, as OpenAI, vLLM and SGLang serve it.

The path of a request with tools, and who owns each piece:

    body.tools / tool_choice / parallel_tool_calls ── parse_tools ──▶ ToolRequest     (400 names the field)
    body.messages[i] (role "tool", assistant "tool_calls") ── history_message ──▶ plain dicts
         (arguments parsed from their JSON string: templates write them with `tojson`)
    the routed model's tokenizer ── template_tools ──▶ the tools its template renders, or 400
         when it has no tool support (tool_choice "none" is accepted there: nothing is parsed)
    tool_choice "required" / a named function ── structured_for ──▶ StructuredOutput (grammar)
         that the engine enforces: exactly the format the parser reads
    the model's text ── ToolCallParser.feed (deltas) / finish ──▶ content + message.tool_calls

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
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.http.errors import ApiError
from pdserve.runtime.structured_output import StructuredOutput, check

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
Choice = Literal["none", "auto", "required", "function"]
# JSON in a forced call is laid out as json.dumps lays it out (what the templates show the model);
# flexible whitespace lets a small model write newlines forever inside a valid object.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# `{"name": "<name>", "arguments": ` at the start of a call; the value must have begun (`{`) so
# that the arguments' text does not depend on where the stream happened to be split.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


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


# ---- parsing the answer -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its first carries id and name (arguments ""), then fragments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | ToolCallDelta


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text the model wrote


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """The whole answer: `deltas` the last ones to stream (what `finish` flushed)."""

    content: str | None  # None when the answer is only tool calls
    tool_calls: tuple[ToolCall, ...]
    deltas: tuple[Delta, ...] = ()


class _ValueEnd:
    """Where a JSON object that starts a text ends: bracket depth, aware of strings and escapes."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it closes)."""
        for k, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return k + 1
        return len(text)


@dataclass
class _OpenCall:
    """The call being read: its text since <tool_call> is the parser's buffer."""

    index: int = -1  # known once its header is read
    scanned: int = 0  # characters of the buffer read as arguments so far
    value: _ValueEnd = field(default_factory=_ValueEnd)


class ToolCallParser:
    """Reads tool calls out of the model's text as it streams: `feed` each text delta, get the
    content and tool-call deltas it completes; `finish` at the end. Whatever way the text is
    split, the deltas add up to the same answer as feeding it whole (`parse_tool_calls`).

    Text that might be the start of a tag ("<tool_c") is held until it is told apart, and so is
    trailing whitespace of the content: beside tool calls it is dropped (the newlines a template
    puts around calls are not content); without any call it is flushed by `finish`."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._buf = ""  # text not yet settled: outside a call, or the open call's body
        self._ws = ""  # content whitespace held back
        self._content: list[str] = []
        self._calls: list[list[str]] = []  # [id, name, arguments fragments...] per call
        self._call: _OpenCall | None = None

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedOutput:
        out: list[Delta] = []
        if self._call is not None:  # cut off before </tool_call>
            self._read_call(self._buf, out)
            if self._call.index < 0:
                self._emit_content(OPEN + self._buf, out)
            self._call = None
        else:
            self._emit_content(self._buf, out)  # a partial tag at the very end is text
        self._buf = ""
        if not self._calls and self._ws:
            self._content.append(self._ws)
            out.append(ContentDelta(self._ws))
        self._ws = ""
        calls = tuple(ToolCall(c[0], c[1], "".join(c[2:])) for c in self._calls)
        content = "".join(self._content)
        return ParsedOutput(None if calls and not content else content, calls, tuple(out))

    def _step(self, out: list[Delta]) -> bool:
        """Settle what the buffer allows; True when it entered or left a call (go again)."""
        if self._call is None:
            i = self._buf.find(OPEN)
            end = i if i >= 0 else len(self._buf) - _partial_tag(self._buf, OPEN)
            self._emit_content(self._buf[:end], out)
            self._buf = self._buf[end + len(OPEN):] if i >= 0 else self._buf[end:]
            if i >= 0:
                self._call = _OpenCall()
            return i >= 0
        j = self._buf.find(CLOSE)
        self._read_call(self._buf[:j] if j >= 0 else self._buf[:len(self._buf) - _partial_tag(self._buf, CLOSE)], out)
        if j < 0:
            return False
        if self._call.index < 0:
            self._read_whole_call(self._buf[:j], out)
        self._buf, self._call = self._buf[j + len(CLOSE):], None
        return True

    def _read_call(self, body: str, out: list[Delta]) -> None:
        """Stream what `body` (the call's text so far, no partial closing tag) settles."""
        call = self._call
        if call.index < 0:
            header = _HEADER.match(body)
            if header is None:
                return
            call.index, call.scanned = self._start_call(header.group(1), out), header.end()
        if call.value.done:
            return
        taken = call.value.feed(body[call.scanned:])
        fragment = body[call.scanned:call.scanned + taken]
        call.scanned += taken
        if fragment:
            self._calls[call.index].append(fragment)
            out.append(ToolCallDelta(call.index, fragment))

    def _read_whole_call(self, body: str, out: list[Delta]) -> None:
        """A closed call whose header was not read as it streamed: any JSON object with a name
        and (optionally) arguments is a call; anything else stays text."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            self._emit_content(OPEN + body + CLOSE, out)
            return
        args = obj.get("arguments", {})
        index = self._start_call(obj["name"], out)
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        self._calls[index].append(text)
        out.append(ToolCallDelta(index, text))

    def _start_call(self, name: str, out: list[Delta]) -> int:
        call_id = self._new_id()
        self._calls.append([call_id, name])
        out.append(ToolCallDelta(len(self._calls) - 1, "", call_id, name))
        return len(self._calls) - 1

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        kept = text.rstrip()
        if not kept:
            self._ws += text
            return
        piece, self._ws = self._ws + kept, text[len(kept):]
        self._content.append(piece)
        out.append(ContentDelta(piece))


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_call_id) -> ParsedOutput:
    """The whole answer's content and tool calls."""
    parser = ToolCallParser(new_id)
    parser.feed(text)
    return parser.finish()


# ---- response JSON ----------------------------------------------------------------------------

def tool_calls_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def message_json(parsed: ParsedOutput) -> dict[str, Any]:
    """The chat.completion's `message` of an answer read for tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = tool_calls_json(parsed.tool_calls)
    return message


def delta_json(delta: Delta) -> dict[str, Any]:
    """A chat.completion.chunk's `delta` for one parser delta, as OpenAI streams tool calls: the
    call's index, id, type and name with arguments "" first, then fragments of its arguments."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    piece: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        piece |= {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": delta.arguments}}
    else:
        piece["function"] = {"arguments": delta.arguments}
    return {"tool_calls": [piece]}


def finish_reason_for(reason: str, parsed: ParsedOutput) -> str:
    """"tool_calls" when the answer called tools and ended by itself; "length" stays (a call cut
    off by max_tokens is worth knowing about)."""
    return "tool_calls" if parsed.tool_calls and reason != "length" else reason
