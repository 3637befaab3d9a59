"""Structured output through a real stack (gateway, 1 prefill, 1 decode, kvstore over gRPC).

The prefill worker samples the first token under the grammar, the decode worker builds its own
matcher, advances it over that token and goes on: the greedy outputs must equal the in-process
engine's and validate (jsonschema, re). A spec that does not compile is refused by the gateway
(INVALID_ARGUMENT, llguidance's message), one that compiles but not for the model's vocabulary by
the workers (the same code), and a decode worker resumed mid-stream (local prefill of the prompt
+ the tokens delivered) continues the same grammar state.
"""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from conftest import STORIES_GGUF
from pdserve.proto_convert import sampling_to_proto
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.structured_output import StructuredOutput
from pdserve.stack import start_stack
from pdserve.v1 import gateway_pb2, worker_pb2, worker_pb2_grpc

PROMPT = "Once upon a time"
PET = {"type": "object", "additionalProperties": False, "required": ["name", "pet"],
       "properties": {"name": {"type": "string", "maxLength": 10},
                      "pet": {"enum": ["cat", "dog", "bird"]}}}
SPECS = {
    "schema": StructuredOutput("json_schema", json.dumps(PET)),
    "regex": StructuredOutput("regex", r"(yes|no), [0-9]{1,3} (cats|dogs)"),
}


@pytest.fixture(scope="module")
def stack():
    s = start_stack(prefill=1, decode=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=256)))


def greedy(so: StructuredOutput, max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured=so)


def generate(stack, so: StructuredOutput) -> tuple[list[int], str, str]:
    chunks = list(stack.gateway_stub().Generate(
        gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling_to_proto(greedy(so))), timeout=120))
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason)


def test_greedy_outputs_equal_the_engine_and_validate(stack, engine, checkpoint):
    prompt = checkpoint.tokenizer.encode(PROMPT)
    for name, so in SPECS.items():
        ids, text, reason = generate(stack, so)
        expected = engine.generate([prompt], greedy(so))[0]
        assert ids == expected.output_ids and reason == expected.finish_reason == "stop", name
        if name == "schema":
            jsonschema.validate(json.loads(text), PET)
        else:
            assert re.fullmatch(so.spec, text)


@pytest.mark.parametrize("so, problem", [
    (StructuredOutput("regex", "a("), "unclosed group"),
    (StructuredOutput("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("grammar", "start: foo"), 'unknown name: "foo"'),
])
def test_a_spec_that_does_not_compile_is_invalid_argument(stack, so, problem):
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, so)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in info.value.details()


def test_a_token_id_the_model_lacks_is_refused_by_the_workers(stack):
    """`<[5000]>` compiles without a tokenizer (the gateway's check) but not against a 512-token
    vocabulary: the prefill worker refuses it and the gateway passes its status on."""
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, StructuredOutput("grammar", 'start: <[5000]> "a"'))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "5000" in info.value.details()


def test_a_resumed_decode_continues_the_grammar(stack, engine, checkpoint):
    """What the gateway sends after losing a decode worker: local prefill of the prompt + the
    tokens delivered, resumed_tokens of them; the worker's matcher starts after them."""
    prompt = checkpoint.tokenizer.encode(PROMPT)
    so = SPECS["schema"]
    whole = engine.generate([prompt], greedy(so))[0].output_ids
    cut = len(whole) // 2
    request = worker_pb2.DecodeRequest(request_id="resume-structured", prompt_token_ids=prompt + whole[:cut],
                                       sampling=sampling_to_proto(greedy(so, 80 - cut)), local_prefill=True,
                                       resumed_tokens=cut)
    with grpc.insecure_channel(stack.child("decode-0").spec.address) as channel:
        chunks = list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=120))
        assert [t for c in chunks for t in c.token_ids] == whole[cut:]
        assert chunks[-1].finish_reason == "stop"
        # A tail the grammar refuses is the caller's error, with the matcher's reason.
        bad = worker_pb2.DecodeRequest(request_id="resume-bad", prompt_token_ids=prompt + [410, 410],
                                       sampling=sampling_to_proto(greedy(so)), local_prefill=True, resumed_tokens=2)
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(bad, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not match the structured output spec" in info.value.details()
