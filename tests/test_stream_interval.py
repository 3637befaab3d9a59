"""`--stream-interval`: a decode worker sends a stream's tokens in chunks of at least N (the first and
the last at once), and what arrives is what the in-process engine generates, token for token, and
through the gateway the same text and logprobs as a stack streaming every token.

Stories260K on a real stack (`pdserve up --stream-interval 4`), the reference the engine in this process.
"""

from __future__ import annotations

import grpc
import pytest

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.proto_convert import sampling_to_proto
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc

INTERVAL = 4
PROMPT = "Once upon a time"
MAX_TOKENS = 23


@pytest.fixture(scope="module")
def stacks():
    every, coalesced = start_stack(1, 1), start_stack(1, 1, "--stream-interval", str(INTERVAL))
    yield every, coalesced
    every.stop()
    coalesced.stop()


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(STORIES_GGUF)


def reference(checkpoint) -> list[int]:
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return engine.generate([checkpoint.tokenizer.encode(PROMPT)], params)[0].output_ids


def test_a_decode_worker_sends_chunks_of_the_interval(stacks, checkpoint):
    _, coalesced = stacks
    prompt = checkpoint.tokenizer.encode(PROMPT)
    request = worker_pb2.DecodeRequest(
        request_id="interval", prompt_token_ids=prompt, local_prefill=True,
        sampling=sampling_to_proto(SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)))
    with grpc.insecure_channel(coalesced.child("decode-0").spec.address) as channel:
        chunks = list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=120))
    assert [t for c in chunks for t in c.token_ids] == reference(checkpoint)
    sizes = [len(c.token_ids) for c in chunks]
    assert all(n >= INTERVAL for n in sizes[1:-1]) and 1 <= sizes[-1] and len(chunks) <= 2 + MAX_TOKENS // INTERVAL
    assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]


def test_through_the_gateway_the_text_and_logprobs_are_those_of_every_token_streamed(stacks, checkpoint):
    def generate(stack) -> list[gateway_pb2.GenerateResponse]:
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
        return list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling),
                                                  timeout=120))

    every, coalesced = (generate(s) for s in stacks)
    assert len(coalesced) < len(every)
    for field in ("token_ids", "logprobs"):
        assert [x for c in coalesced for x in getattr(c, field)] == [x for c in every for x in getattr(c, field)]
    assert "".join(c.text for c in coalesced) == "".join(c.text for c in every)
    assert [t for c in every for t in c.token_ids] == reference(checkpoint)
    assert coalesced[-1].usage == every[-1].usage and coalesced[-1].finish_reason == "length"


def test_an_interval_below_one_is_refused_before_anything_starts(capsys: pytest.CaptureFixture) -> None:
    args = build_parser().parse_args(["up", "--stream-interval", "0"])
    assert args._run(args) == 2
    assert capsys.readouterr().err.strip() == "pdserve up: --stream-interval must be at least 1 token, got 0"
