"""Fuzzing the gateway's gRPC API: generated Generate and Chat requests (odd prompts, sampling
values out of range, NaN and inf, many or long stop strings, odd roles and ids) and raw random
bytes as the serialized request. Every call must end OK or with a documented status and a
message; afterwards the stack still serves the reference output and holds no KV."""

from __future__ import annotations

import grpc
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzz_support import (FUZZ, assert_documented, assert_still_healthy, expected,  # noqa: F401 (fixture)
                          stack_fixture, stream_outcome)
from pdserve.v1 import common_pb2, gateway_pb2

INT32 = st.one_of(st.sampled_from([0, -1, 1, 2**31 - 1, -2**31, 511, 512, 100000]),
                  st.integers(-2**31, 2**31 - 1))
FLOAT = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, float("nan"), float("inf"), float("-inf"),
                                   1e30, -1e30, 1e-30, 3.4e38]),
                  st.floats(width=32))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # protobuf strings are UTF-8
PROMPT = st.one_of(TEXT, st.sampled_from(["", " ", "\x00", "Once upon a time", "🙂" * 300, "\n" * 50]),
                   st.builds(lambda s, n: s * n, st.sampled_from(["a", "Tom ", "é"]),
                             st.integers(1, 4000)))


ODD_FLOAT = st.sampled_from([float("nan"), float("inf"), 1e30])


def near(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values in range, sometimes odd ones: such requests get past validation."""
    return st.one_of(valid, valid, valid, ODD_FLOAT)


WILD = dict(max_tokens=INT32, temperature=FLOAT, top_p=FLOAT, repetition_penalty=FLOAT, top_k=INT32,
            min_p=FLOAT, logprobs=INT32, stop_token_ids=st.lists(INT32, max_size=8))
NEAR_VALID = dict(max_tokens=st.integers(-1, 48), temperature=near(st.floats(0, 2)), top_p=near(st.floats(0.01, 1)),
                  repetition_penalty=near(st.floats(0.5, 2)), top_k=st.integers(0, 50), min_p=near(st.floats(0, 1)),
                  logprobs=st.integers(0, 21), stop_token_ids=st.lists(st.integers(-1, 600), max_size=4))
OPTIONAL = ("max_tokens", "temperature", "top_p", "repetition_penalty")


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    """Either wild values anywhere in their proto type, or near-valid ones that reach the workers."""
    values = draw(st.sampled_from([WILD, NEAR_VALID]))
    msg = common_pb2.SamplingParams(
        top_k=draw(values["top_k"]), min_p=draw(values["min_p"]), logprobs=draw(values["logprobs"]),
        ignore_eos=draw(st.booleans()), stop_token_ids=draw(values["stop_token_ids"]),
        stop=draw(st.lists(st.one_of(TEXT, st.just(""), st.just("x" * 5000)), max_size=8)))
    for name in OPTIONAL:
        if draw(st.booleans()):
            setattr(msg, name, draw(values[name]))
    if draw(st.booleans()):
        msg.seed = draw(st.integers(0, 2**64 - 1))
    return msg


FUZZ_SETTINGS = settings(FUZZ, max_examples=60)
REQUEST_ID = st.one_of(st.just(""), TEXT, st.just("r" * 10000))
VALID_ROLE = st.sampled_from(["system", "user", "assistant"])
ROLE = st.one_of(VALID_ROLE, VALID_ROLE, VALID_ROLE, st.sampled_from(["", "tool", "USER"]), TEXT)
MESSAGES = st.lists(st.builds(gateway_pb2.ChatMessage, role=ROLE, content=PROMPT), max_size=5)


stack = stack_fixture()


@FUZZ_SETTINGS
@given(prompt=PROMPT, params=sampling(), request_id=REQUEST_ID, session=st.one_of(st.just(""), TEXT))
def test_generate_requests(stack, prompt, params, request_id, session):
    request = gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt, sampling=params, session_id=session)
    code, details = stream_outcome(stack.gateway_stub().Generate(request, timeout=30))
    event(code.name)
    assert_documented(code, details, request)


@FUZZ_SETTINGS
@given(messages=MESSAGES, params=sampling(), request_id=REQUEST_ID)
def test_chat_requests(stack, messages, params, request_id):
    request = gateway_pb2.ChatRequest(request_id=request_id, messages=messages, sampling=params)
    code, details = stream_outcome(stack.gateway_stub().Chat(request, timeout=30))
    event(code.name)
    assert_documented(code, details, request)


@FUZZ_SETTINGS
@given(method=st.sampled_from(["Generate", "Chat"]), payload=st.binary(max_size=300))
def test_raw_bytes_as_request(stack, method, payload):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        call = channel.unary_stream(f"/pdserve.v1.Gateway/{method}")(payload, timeout=30)
        code, details = stream_outcome(call)
    assert_documented(code, details, payload)


@settings(FUZZ, max_examples=20)
@given(timeout_s=st.floats(0.001, 0.5), max_tokens=st.integers(1, 48))
def test_client_deadlines_in_any_phase(stack, timeout_s, max_tokens):
    # A deadline that expires during tokenizing, prefill or decode: the statuses stay documented and
    # the final check finds no KV held for these requests.
    request = gateway_pb2.GenerateRequest(prompt="Once upon a time, there was a", sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0))
    code, details = stream_outcome(stack.gateway_stub().Generate(request, timeout=timeout_s), max_chunks=1000)
    event(code.name)
    assert_documented(code, details, request)


def test_stack_healthy_after_fuzzing(stack, expected):
    assert_still_healthy(stack, expected)
