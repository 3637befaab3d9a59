"""Tool calling (gateway.http.tools and tool_calls, tokenizers' tools=): against transformers, llguidance and the
OpenAI SDK, on a small HF checkpoint with Qwen2.5's chat template written here.

- rendering a tool conversation equals transformers' apply_chat_template(messages, tools=...);
- the parser's own tests are in test_tool_calls.py; here, what the grammar accepts it reads back;
- the grammar of tool_choice "required" / a named function accepts the tokens of a valid call and
  refuses invalid ones (llguidance's matcher over the checkpoint's tokenizer); calls sampled at
  random from it parse into arguments that jsonschema finds valid;
- every bad request is a 400 naming its field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from gateway.http.errors import ApiError
from gateway.http.tool_calls import parse_tool_calls
from gateway.http.tools import (ToolRequest, history_message, parse_tools, structured_for, tags_are_tokens,
                                template_tools)
from gateway.prompts import prompt_chars, tokenize_chat
from pdserve.runtime.gguf_reader import load_gguf_tokenizer
from pdserve.runtime.structured_output import grammar_text
from pdserve.runtime.tokenizer import GGUFTokenizer, HFTokenizer, default_chat_prompt, template_supports_tools

from hermes_reference import reference

STORIES = Path(__file__).resolve().parent / "fixtures/stories260K/stories260K.gguf"

# Qwen2.5-Instruct's chat template (its tokenizer_config.json), the Hermes tool format.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather <now> & 'here' in a city (café, 日本)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
FORECAST = {"type": "function", "function": {
    "name": "forecast", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "hourly": {"type": "boolean"}},
        "required": ["unit", "days", "hourly"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, FORECAST, CLOCK]

TRAINING_TEXT = ['<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n',
                 '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}',
                 '{"name": "forecast", "arguments": {"unit": "f", "days": 3, "hourly": true}}',
                 "You are a helpful assistant. You may call one or more functions.", "<tool_response>\n"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen_style")
    write_tool_tokenizer(path)
    return path


def write_tool_tokenizer(path: Path):
    """A HF tokenizer directory at `path`: byte-level BPE trained on a few lines, ChatML special
    tokens, <tool_call> and </tool_call> as added tokens (as Qwen2.5 has them), Qwen2.5's
    template. Returns the transformers tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer)
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                    AddedToken("</tool_call>", special=False, normalized=False)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = QWEN_TEMPLATE
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def hf(checkpoint: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def ll_tokenizer(hf):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf)


def gguf_style(checkpoint: Path, hf) -> GGUFTokenizer:
    """The same vocabulary and template behind GGUFTokenizer: our own Jinja rendering."""
    from tokenizers import Tokenizer

    return GGUFTokenizer(Tokenizer.from_file(str(checkpoint / "tokenizer.json")), None, [hf.eos_token_id],
                         chat_template=QWEN_TEMPLATE)


# ---- rendering -------------------------------------------------------------------------------

# A tool conversation as an OpenAI client sends it: arguments as JSON strings, content null.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Zürich, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, <sunny> & dry"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12 C"}]},
    {"role": "assistant", "content": "Let me check the time.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "10:00"},
    {"role": "assistant", "content": "Paris 18 C, Zürich 12 C, 10:00."},
    {"role": "user", "content": "Thanks!"},
]
# What transformers' documentation has templates take: arguments as objects, no null keys.
REFERENCE_CONVERSATION = [
    CONVERSATION[0], CONVERSATION[1],
    {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}]},
    CONVERSATION[3], {"role": "tool", "tool_call_id": "call_2", "content": "12 C"},
    {"role": "assistant", "content": "Let me check the time.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    *CONVERSATION[6:],
]


def our_messages(conversation: list[dict]) -> list[dict]:
    """The messages as the HTTP edge hands them to the template (history_message for tool ones)."""
    return [history_message(m, i) or m for i, m in enumerate(conversation)]


def test_tool_conversation_renders_as_transformers(checkpoint: Path, hf) -> None:
    expected = hf.apply_chat_template(REFERENCE_CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in expected and '"arguments": {"city": "Z\u00fcrich", "unit": "c"}' in expected
    messages = our_messages(CONVERSATION)
    hf_ours, gguf_ours = HFTokenizer.from_directory(checkpoint), gguf_style(checkpoint, hf)
    assert hf_ours.supports_tools and gguf_ours.supports_tools
    assert hf_ours.apply_chat_template(messages, TOOLS) == expected
    assert gguf_ours.apply_chat_template(messages, TOOLS) == expected  # our Jinja environment: tojson as theirs
    ids = hf.encode(expected, add_special_tokens=False)
    assert tokenize_chat(hf_ours, messages, TOOLS) == ids == tokenize_chat(gguf_ours, messages, TOOLS)
    # The tools' JSON and the calls count as characters of the prompt (the limit before rendering).
    assert prompt_chars("", messages, TOOLS) > sum(len(json.dumps(t)) for t in TOOLS) + len("Thanks!")


def test_chat_without_tools_renders_as_before(checkpoint: Path, hf) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in expected
    assert gguf_style(checkpoint, hf).apply_chat_template(messages) == expected
    assert HFTokenizer.from_directory(checkpoint).apply_chat_template(messages) == expected


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from conftest import smollm2_path

    return load_gguf_tokenizer(smollm2_path())


def test_templates_without_tool_support(smollm2_tokenizer) -> None:
    assert template_supports_tools(QWEN_TEMPLATE)
    assert template_supports_tools({"default": "x", "tool_use": "{{ tools }}"})  # a checkpoint's named templates
    stories = load_gguf_tokenizer(STORIES)  # pdserve's default "role: content" template
    for tok in (smollm2_tokenizer, stories):
        assert not tok.supports_tools
        with pytest.raises(ValueError, match="no tool support"):
            tok.apply_chat_template([{"role": "user", "content": "Hi"}], [WEATHER])
        with pytest.raises(ValueError, match="no tool support"):
            tok.apply_chat_template(our_messages(CONVERSATION[:4]))  # role "tool"
        with pytest.raises(ValueError, match=r"messages\[2\] has tool_calls.*no tool support"):
            tok.apply_chat_template(our_messages(CONVERSATION[:3]))
    assert stories.apply_chat_template(CONVERSATION[:2]) == default_chat_prompt(CONVERSATION[:2])
    # At the HTTP edge: a 400 naming tools, except tool_choice "none" (nothing to parse; tools left out).
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(ApiError, match="chat template has no tool support") as err:
            template_tools(parse_tools({"tools": [WEATHER], "tool_choice": choice}), smollm2_tokenizer.supports_tools)
        assert (err.value.status, err.value.param) == (400, "tools")
    assert template_tools(parse_tools({"tools": [WEATHER], "tool_choice": "none"}), False) is None
    assert template_tools(parse_tools({"tools": [WEATHER], "tool_choice": "none"}), True) == (WEATHER,)
    assert template_tools(None, False) is None


# ---- constrained calls -----------------------------------------------------------------------

def matcher(ll_tokenizer, request: ToolRequest, tag_tokens: bool = True):
    from llguidance import LLMatcher

    so = structured_for(request, tag_tokens=tag_tokens)
    m = LLMatcher(ll_tokenizer, grammar_text(so), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(ll_tokenizer, request: ToolRequest, ids: list[int], tag_tokens: bool = True) -> bool:
    m = matcher(ll_tokenizer, request, tag_tokens)
    return m.consume_tokens(ids) and m.is_accepting()


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


NAMED = ToolRequest(tuple(TOOLS), "function", "get_weather")
REQUIRED = ToolRequest(tuple(TOOLS), "required")


@pytest.mark.parametrize("request_, text, ok", [
    (NAMED, call_text("get_weather", {"city": "Paris"}), True),
    (NAMED, call_text("get_weather", {"city": "Paris", "unit": "f"}), True),
    (NAMED, call_text("forecast", {"unit": "c", "days": 2, "hourly": False}), False),  # not the named one
    (NAMED, call_text("get_weather", {"unit": "c"}), False),  # city is required
    (NAMED, call_text("get_weather", {"city": "Paris", "wind": 1}), False),  # no other properties
    (NAMED, call_text("get_weather", {"city": 5}), False),
    (NAMED, "Sure! " + call_text("get_weather", {"city": "Paris"}), False),  # nothing before the call
    (NAMED, call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_weather", {"city": "Rome"}), False),
    (REQUIRED, call_text("forecast", {"unit": "c", "days": 7, "hourly": True}), True),
    (REQUIRED, call_text("get_time", {}), True),
    (REQUIRED, call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("get_time", {}), True),
    (REQUIRED, call_text("forecast", {"unit": "c", "days": 8, "hourly": True}), False),  # maximum 7
    (REQUIRED, call_text("get_time", {"now": True}), False),  # no parameters
    (REQUIRED, call_text("launch", {}), False),  # not a listed tool
    (REQUIRED, "The weather is fine.", False),  # required: a call, not prose
    (ToolRequest(tuple(TOOLS), "required", parallel=False),
     call_text("get_time", {}) + "\n" + call_text("get_time", {}), False),
])
def test_grammar_accepts_valid_calls_only(hf, ll_tokenizer, request_: ToolRequest, text: str, ok: bool) -> None:
    ids = hf.encode(text, add_special_tokens=False)
    assert accepts(ll_tokenizer, request_, ids) is ok
    if ok:  # and what it accepts, the parser reads back as the call written
        assert [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text).tool_calls] == reference(text)[1]


def test_grammar_with_tags_as_text(hf, ll_tokenizer) -> None:
    """A vocabulary without the tag tokens: the grammar asks for the tags as text (llguidance never
    lets an added token stand for its text, so the token form is refused there, and vice versa)."""
    text = call_text("get_weather", {"city": "Paris"})
    tag_ids = hf.encode(text, add_special_tokens=False)
    # The same text spelled without the added tokens: "<tool" + "_call>..." encode apart.
    spelled = [i for part in ("<tool", "_call>" + text[len("<tool_call>"):-len("</tool_call>")], "</tool", "_call>")
               for i in hf.encode(part, add_special_tokens=False)]
    assert hf.decode(spelled) == text and len(spelled) > len(tag_ids)
    assert accepts(ll_tokenizer, NAMED, spelled, tag_tokens=False)
    assert not accepts(ll_tokenizer, NAMED, tag_ids, tag_tokens=False)
    assert not accepts(ll_tokenizer, NAMED, spelled, tag_tokens=True)
    assert tags_are_tokens(HFTokenizer.from_directory(hf.name_or_path))
    assert not tags_are_tokens(load_gguf_tokenizer(STORIES))


def test_sampled_calls_parse_and_validate(hf, ll_tokenizer) -> None:
    """Random walks through the grammar of tool_choice "required" (any allowed token, the end
    included): every answer parses into calls of listed tools whose arguments jsonschema accepts."""
    request = ToolRequest((FORECAST, CLOCK), "required")  # no free-form strings: every walk ends
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "maxProperties": 0}
               for t in request.tools}
    rng = random.Random(7)
    for _ in range(6):
        m = matcher(ll_tokenizer, request)
        ids: list[int] = []
        for _ in range(400):
            allowed = _allowed(m.compute_bitmask(), len(hf))
            token = rng.choice(allowed + [hf.eos_token_id] * (len(allowed) if m.is_accepting() else 0))
            if token == hf.eos_token_id:
                break
            assert m.consume_token(token)
            ids.append(token)
        assert m.is_accepting()
        parsed = parse_tool_calls(hf.decode(ids, skip_special_tokens=True))
        assert parsed.content is None and parsed.tool_calls
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def _allowed(bitmask: bytes, vocab: int) -> list[int]:
    return [t for t in range(vocab) if bitmask[t // 8] >> (t % 8) & 1 and t != 0]


def test_structured_only_for_required_and_named() -> None:
    assert structured_for(ToolRequest((WEATHER,), "auto")) is None
    assert structured_for(ToolRequest((WEATHER,), "none")) is None
    assert structured_for(NAMED).kind == "grammar"


# ---- 400s ------------------------------------------------------------------------------------

def fn(name: str = "f", **extra) -> dict:
    return {"type": "function", "function": {"name": name, **extra}}


@pytest.mark.parametrize("body, param", [
    ({"tools": {}}, "tools"),
    ({"tools": [fn()] * 129}, "tools"),
    ({"tools": [1]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [fn("a"), fn("b"), fn("get weather")]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [fn("x" * 65)]}, "tools[0].function.name"),
    ({"tools": [fn("a"), fn("a")]}, "tools[1].function.name"),
    ({"tools": [fn(description=5)]}, "tools[0].function.description"),
    ({"tools": [fn(parameters="x")]}, "tools[0].function.parameters"),
    ({"tools": [fn(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [fn()], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [fn()], "tool_choice": {"type": "other"}}, "tool_choice.type"),
    ({"tools": [fn()], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tools": [fn()], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_tools(body)
    assert (err.value.status, err.value.param) == (400, param), err.value.message
    assert param.split("[")[0].split(".")[0] in err.value.message


def test_tools_parsed() -> None:
    for body in ({}, {"tools": None}, {"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto"},
                 {"tools": [], "tool_choice": "auto"}):
        assert parse_tools(body) is None
    assert parse_tools({"tools": TOOLS}) == ToolRequest(tuple(TOOLS), "auto")
    got = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "forecast"}},
                       "parallel_tool_calls": False})
    assert got == ToolRequest(tuple(TOOLS), "function", "forecast", parallel=False)
    assert got.names == ("get_weather", "forecast", "get_time") and got.parses
    assert not parse_tools({"tools": TOOLS, "tool_choice": "none"}).parses


def call(**fields) -> dict:
    base = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return {**base, **fields}


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "", "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "c", "content": 5}, "messages[1].content"),
    ({"role": "tool", "tool_call_id": "c", "content": [{"type": "image_url"}]}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": "x"}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [5]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [call(), call(id=None)]}, "messages[1].tool_calls[1].id"),
    ({"role": "assistant", "tool_calls": [call(type="code")]}, "messages[1].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [call(function={"arguments": "{}"})]}, "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [call(function={"name": "f", "arguments": "{oops"})]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [call(function={"name": "f", "arguments": "[1]"})]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": 5, "tool_calls": [call()]}, "messages[1].content"),
])
def test_bad_history_is_400_naming_the_field(message: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        history_message(message, 1)
    assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_history_messages() -> None:
    assert history_message({"role": "user", "content": "Hi"}, 0) is None
    assert history_message({"role": "assistant", "content": "Hi", "tool_calls": []}, 0) is None
    assert history_message({"role": "tool", "tool_call_id": "c", "name": "f", "content": None}, 0) == {
        "role": "tool", "tool_call_id": "c", "content": "", "name": "f"}
    got = history_message({"role": "assistant", "content": None, "tool_calls": [
        call(function={"name": "f", "arguments": {"a": 1}}),
        {"id": "c2", "function": {"name": "g", "arguments": ""}}]}, 0)
    assert got == {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]}


def test_parameters_llguidance_refuses_are_400() -> None:
    bad = fn("g", parameters={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ApiError) as err:
        structured_for(ToolRequest((fn(), bad), "required"))
    assert (err.value.status, err.value.param) == (400, "tools[1].function.parameters"), err.value.message
    assert structured_for(ToolRequest((fn(), bad), "function", "f")) is not None  # only the named tool counts
