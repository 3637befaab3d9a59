"""The tool-call parser (gateway.http.tool_calls) against a regex + json reading of the same text
(hermes_reference, what vLLM's Hermes parser does) and the OpenAI SDK:

- on the whole text and on the text split anywhere, the parser equals the reference;
- malformed and cut-off calls come back as content, not lost;
- its stream, accumulated by the OpenAI SDK's own stream state, equals the whole answer.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gateway.http.tool_calls import (ContentDelta, ParsedOutput, ToolCall, ToolCallDelta, ToolCallParser, delta_json,
                                     finish_reason_for, message_json, parse_tool_calls)

from hermes_reference import reference


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRICKY = ('<tool_call>\n{"name": "search", "arguments": {"q": "a } ] { [ \\" \\\\ </tool <tool_call", '
          '"n": [1, {"x": null}], "t": true, "u": "Z\u00fcrich \u65e5\u672c \ud83d\ude00"}}\n</tool_call>')
WELL_FORMED = [
    "The capital of France is Paris.",
    "Ends with blank lines.\n\n",
    "",
    CALL,
    "Let me look that up.\n" + CALL,
    CALL + "\n" + CALL.replace("Paris", "Rome"),
    CALL + "\nDone: see above.\n",
    "  " + CALL + "\n\n",
    TRICKY,
    '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',
    '<tool_call>\n  {\n "name" : "get_weather" ,\n "arguments" :\n {"city": "Paris"}\n}\n</tool_call>',
    '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>',  # keys swapped
    '<tool_call>\n{"name": "get_time"}\n</tool_call>',  # no arguments
    "a < b, <tool> and <tool_calls are text <tool_call",  # tags that are not, and one cut short
]


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def streamed(pieces: list[str]) -> tuple[list, ParsedOutput]:
    parser = ToolCallParser(counter_ids())
    deltas = [d for p in pieces for d in parser.feed(p)]
    end = parser.finish()
    return deltas + list(end.deltas), end


def assemble(deltas: list) -> tuple[str, list[ToolCall]]:
    """What a client makes of the stream: the content, and each call from its deltas."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
        elif d.id is not None:
            assert d.index == len(calls) and d.arguments == ""
            calls.append(ToolCall(d.id, d.name, ""))
        else:
            calls[d.index] = ToolCall(calls[d.index].id, calls[d.index].name, calls[d.index].arguments + d.arguments)
    return content, calls


@pytest.mark.parametrize("text", WELL_FORMED)
def test_parse_matches_reference(text: str) -> None:
    parsed = parse_tool_calls(text, counter_ids())
    content, calls = reference(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert [c.id for c in parsed.tool_calls] == [f"call_{k}" for k in range(len(calls))]
    if text.startswith(CALL):
        assert parsed.tool_calls[0].arguments == '{"city": "Paris"}'  # the model's text, as written


CUT_SHORT = [
    ("x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, [("get_weather", '{"city": "Par')]),
    ('Hi <tool_call>\n{"na', 'Hi <tool_call>\n{"na', []),
    (CALL + "\n<tool_call>\n[1, 2]\n</tool_call>", "\n<tool_call>\n[1, 2]\n</tool_call>",
     [("get_weather", '{"city": "Paris"}')]),
]


@pytest.mark.parametrize("text, content, calls", CUT_SHORT)
def test_parse_of_malformed_and_cut_calls(text: str, content: str | None, calls: list) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("text", WELL_FORMED + [t for t, _, _ in CUT_SHORT])
def test_streamed_at_any_split_equals_whole(text: str) -> None:
    whole = parse_tool_calls(text, counter_ids())
    rng = random.Random(len(text))
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 6)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        deltas, end = streamed(pieces)
        content, calls = assemble(deltas)
        assert (content or None, calls) == (whole.content or None, list(whole.tool_calls)), pieces
        assert end == ParsedOutput(whole.content, whole.tool_calls, end.deltas)


def test_arguments_stream_as_they_are_generated() -> None:
    parser = ToolCallParser(counter_ids())
    assert parser.feed("Sure.\n<tool_call>\n{\"name\": \"get_weather\", ") == [ContentDelta("Sure.")]
    assert parser.feed('"arguments": {"ci') == [ToolCallDelta(0, "", "call_0", "get_weather"), ToolCallDelta(0, '{"ci')]
    assert parser.feed('ty": "Paris"}}\n</tool') == [ToolCallDelta(0, 'ty": "Paris"}')]
    assert parser.feed("_call>") == []
    end = parser.finish()
    assert (end.content, end.deltas) == ("Sure.", ())
    assert finish_reason_for("stop", end) == "tool_calls" and finish_reason_for("length", end) == "length"
    assert finish_reason_for("stop", parse_tool_calls("no calls")) == "stop"


@pytest.mark.parametrize("text", [CALL, "Checking.\n" + CALL + "\n" + TRICKY, "Plain answer.\n"])
def test_stream_accumulated_by_openai_sdk_equals_whole(text: str) -> None:
    """The chunks, accumulated by the OpenAI SDK's own stream state, give the non-streamed message."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    whole = parse_tool_calls(text, counter_ids())
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    state = ChatCompletionStreamState()
    deltas, _ = streamed([text[k:k + 3] for k in range(0, len(text), 3)])
    chunks = [{"role": "assistant"}] + [delta_json(d) for d in deltas]
    for k, delta in enumerate(chunks):
        reason = finish_reason_for("stop", whole) if k == len(chunks) - 1 else None
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**envelope, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}))
    final = state.get_final_completion().choices[0]
    reference_msg = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": message_json(whole), "finish_reason": finish_reason_for("stop", whole)}],
    }).choices[0]
    assert final.finish_reason == reference_msg.finish_reason == ("tool_calls" if whole.tool_calls else "stop")
    assert final.message.content == reference_msg.message.content
    got = [(c.id, c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls or []]
    want = [(c.id, c.type, c.function.name, c.function.arguments) for c in reference_msg.message.tool_calls or []]
    assert got == want and len(got) == len(whole.tool_calls)


def test_message_json_shapes() -> None:
    parsed = parse_tool_calls(CALL, counter_ids())
    assert message_json(parsed) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert message_json(parse_tool_calls("Hi")) == {"role": "assistant", "content": "Hi"}
    assert delta_json(ToolCallDelta(1, '{"a"')) == {"tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]}
