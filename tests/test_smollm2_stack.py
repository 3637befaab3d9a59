"""The disaggregated stack serving SmolLM2 equals the in-process engine: greedy, chat prompts, gRPC and HTTP.

One stack (1 prefill, 1 decode, HTTP on) for the module, started with `--model` the SmolLM2 file
(the suite's default model is stories260K). Answers end at the chat template's `<|im_end|>`. The
questions are sent at once, so the decode worker batches them as the engine did for `expected`.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import TypeVar

import openai
import pytest

from conftest import smollm2_path
from pdserve.ports import free_port
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2

QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "Say hello in French."]
MAX_TOKENS = 24
MODEL = "SmolLM2-135M-Instruct"  # the file's name without ".Q4_1.gguf"
T = TypeVar("T")


def at_once(send: Callable[[str], T], questions: Sequence[str]) -> list[T]:
    """`send` of every question, all in flight together; the results in the questions' order."""
    with cf.ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(send, questions))


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--model", str(smollm2_path()), "--http-port", str(free_port()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected(smollm2) -> list[tuple[list[int], str]]:
    """The in-process engine's greedy ids and text for each question."""
    engine = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=64)))
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    engine.check_leaks()
    # The stream leaves the end-of-turn id out of the text; the ids keep it.
    return [(s.output_ids, tok.decode(s.output_ids)) for s in seqs]


def test_grpc_chat_equals_the_engine(stack, expected) -> None:
    def chat(question: str) -> list[gateway_pb2.GenerateResponse]:
        req = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content=question)],
                                      sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        return list(stack.gateway_stub().Chat(req, timeout=120))

    for question, chunks, (ids, text) in zip(QUESTIONS, at_once(chat, QUESTIONS), expected):
        assert [t for c in chunks for t in c.token_ids] == ids, question
        assert "".join(c.text for c in chunks) == text


def test_http_chat_equals_the_engine(stack, expected) -> None:
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]

    def chat(question: str):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                              max_tokens=MAX_TOKENS, temperature=0)

    for reply, (_, text) in zip(at_once(chat, QUESTIONS), expected):
        assert reply.model == MODEL and reply.choices[0].message.content == text
    assert "Paris" in expected[0][1]
