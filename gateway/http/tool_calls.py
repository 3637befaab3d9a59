"""The model's answer to a chat with tools, read for tool calls (Hermes' and Qwen2.5's format:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as gateway.http.tools describes), and
the chat.completion JSON of what was read: content and `tool_calls`, whole or as stream deltas.
The request side (tools, tool_choice, the grammar that forces a call) is gateway.http.tools."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# `{"name": "<name>", "arguments": ` at the start of a call; the value must have begun (`{`) so
# that the arguments' text does not depend on where the stream happened to be split.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


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
