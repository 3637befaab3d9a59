"""Workers SIGKILLed under a running stack: streams end cleanly, survivors take new requests."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest

from conftest import STORIES_GGUF
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2
from pdserve.stack import start_stack

PROMPT = "Once upon a time, in a small town, there lived a kind old man who"


@pytest.fixture(scope="module")
def stack():
    s = start_stack(prefill=2, decode=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected():
    checkpoint = load_checkpoint(STORIES_GGUF)
    ids = checkpoint.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=20, temperature=0)
    return Engine.from_checkpoint(checkpoint).generate([ids], params)[0].output_ids


def _generate(stack, max_tokens: int = 20, **kw):
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw))
    return stack.gateway_stub().Generate(request, timeout=60)


def _tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def test_decode_worker_killed_mid_stream(stack, expected):
    streams = [_generate(stack, 400, ignore_eos=True) for _ in range(4)]  # spread over both decoders
    firsts = [next(s) for s in streams]
    assert all(f.token_ids for f in firsts)
    stack.kill("decode-0")
    outcomes = []
    for s in streams:
        try:
            _tokens(s)
            outcomes.append("completed")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            outcomes.append("unavailable")
    assert "unavailable" in outcomes  # at least one stream lived on decode-0
    with cf.ThreadPoolExecutor(4) as pool:  # new requests succeed on the survivor
        results = list(pool.map(lambda _: _tokens(_generate(stack)), range(6)))
    assert all(r == expected for r in results)


def test_prefill_worker_killed(stack, expected):
    stack.kill("prefill-0")
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _tokens(_generate(stack)), range(6)))
    assert all(r == expected for r in results)
