"""Tool calling through a real stack over HTTP with the official SDK: a random-weight Qwen2
checkpoint whose tokenizer has Qwen2.5's chat template (tools, tool calls, tool results) and
<tool_call> tags as added tokens.

A random model never calls a tool by itself, so the calls come from tool_choice "required" and a
named function, which constrain the answer to a call (gateway.http.tools.structured_for): the
response's tool_calls must name the tool, carry arguments that validate against its schema, say
finish_reason "tool_calls", and stream (accumulated by the SDK's own stream state) to the same
message. A conversation with the call and its result in history must be rendered as transformers
renders it: the stack's prompt_tokens equal transformers' apply_chat_template(..., tools=...).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from conftest import random_hf_model
from pdserve.ports import free_port
from pdserve.stack import start_stack
from test_tools import CLOCK, FORECAST, write_tool_tokenizer

MODEL_NAME = "qwen-tools"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qwen_tools_model")
    tokenizer = write_tool_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = random_hf_model("qwen2", seed=5, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                            max_position_embeddings=2048)
    model.save_pretrained(path)
    return path, tokenizer


@pytest.fixture(scope="module")
def stack(checkpoint):
    path, _ = checkpoint
    s = start_stack(1, 1, "--model", str(path), "--served-model-name", MODEL_NAME, "--http-port", str(free_port()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _ask(client: openai.OpenAI, tools: list, tool_choice, **extra):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice=tool_choice,
                                          temperature=0, max_tokens=96, **extra)


def _streamed(client: openai.OpenAI, tools: list, tool_choice, **extra):
    state = ChatCompletionStreamState()
    for chunk in _ask(client, tools, tool_choice, stream=True, **extra):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def _check_calls(message, tools: list) -> None:
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_function_is_called_with_valid_arguments_whole_and_streamed(client) -> None:
    choice = {"type": "function", "function": {"name": "forecast"}}
    whole = _ask(client, [FORECAST, CLOCK], choice).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls] == ["forecast"]
    _check_calls(whole.message, [FORECAST, CLOCK])
    streamed = _streamed(client, [FORECAST, CLOCK], choice).choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_required_makes_one_call_of_a_listed_tool(client) -> None:
    message = _ask(client, [FORECAST, CLOCK], "required", parallel_tool_calls=False).choices[0].message
    assert len(message.tool_calls) == 1
    _check_calls(message, [FORECAST, CLOCK])


def test_history_with_a_call_and_its_result_renders_as_transformers(client, checkpoint) -> None:
    _, tokenizer = checkpoint
    call = {"id": "call_1", "type": "function",
            "function": {"name": "forecast", "arguments": json.dumps({"unit": "c", "days": 2, "hourly": False})}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"high": 21}'}]
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[FORECAST, CLOCK],
                                            temperature=0, max_tokens=4)
    # transformers renders the arguments object (templates write it with tojson), as we do
    hf_messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}]},
        messages[2]]
    ids = tokenizer.apply_chat_template(hf_messages, tools=[FORECAST, CLOCK], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert answer.usage.prompt_tokens == len(ids)
