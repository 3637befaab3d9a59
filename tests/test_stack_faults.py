"""Processes SIGKILLed under a running stack (docs/reliability.md): a decode worker mid-stream (its
streams resume elsewhere from the stored KV), prefill workers (retry, then local prefill), the
gateway (in-flight streams fail UNAVAILABLE, a retry after its restart succeeds). Every output is
compared with the in-process engine's greedy run of the same prompt."""

from __future__ import annotations

import concurrent.futures as cf

import grpc
import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, kvstore_pb2, worker_pb2, worker_pb2_grpc
from waiting import wait_until

PROMPTS = (
    "Once upon a time, in a small town, there lived a kind old man who",
    "Lily and Ben went to the park to play with a ball. They",
    "The little dog was sad because it lost its red",
    "One day a big bird flew over the sea and saw a",
)
LONG = 1000  # tokens per stream in the decode-kill test: mid-stream at the kill even on a fast machine
SHORT = 20
LONG_PROMPT = "prompt 0, 12 times"
READ_BEFORE_KILL = 96  # tokens each stream has delivered when its worker is killed (> 5 blocks)
FILLED_BEFORE_KILL = 5  # full blocks of generated tokens each stream has then (its last token's KV is not yet)


@pytest.fixture(scope="module")
def stack():
    s = start_stack(2, 2, "--disagg-policy", "always-remote")  # every prompt meets a prefill worker
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    """{(prompt, max_tokens): greedy output ids} of the in-process engine; (prompt, 0): its ids."""
    torch.set_num_threads(1)  # the stack's processes use the other cores; more threads thrash
    checkpoint = load_checkpoint(STORIES_GGUF)
    engine = Engine.from_checkpoint(checkpoint)
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    out = {(p, 0): ids for p, ids in zip(PROMPTS, prompts)}
    out[(LONG_PROMPT, 1)] = engine.generate([_long_prompt(out)], SamplingParams(max_tokens=1, temperature=0))[0].output_ids
    for n in (SHORT, LONG):
        seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out.update({(p, n): s.output_ids for p, s in zip(PROMPTS, seqs)})
    return out


def _long_prompt(reference) -> list[int]:
    """About 350 tokens: a prefill long enough for two calls to overlap."""
    return reference[(PROMPTS[0], 0)] * 12


def _generate(stack, prompt: str = PROMPTS[0], max_tokens: int = SHORT):
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return stack.gateway_stub().Generate(request, timeout=120)


def _tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def _all_correct(stack, reference, n: int = 8) -> None:
    """`n` concurrent short requests over all prompts; each equals the reference."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _tokens(_generate(stack, p)), prompts))
    assert [r == reference[(p, SHORT)] for p, r in zip(prompts, results)] == [True] * n


def test_decode_worker_killed_mid_stream(stack, reference):
    sent_before = stack.worker_stats("decode-0").kv_bytes_sent
    streams = [_generate(stack, p, LONG) for p in PROMPTS]  # spread over both decode workers
    got: list[list[int]] = [[] for _ in streams]
    for tokens, stream in zip(got, streams):
        while len(tokens) < READ_BEFORE_KILL:
            tokens.extend(next(stream).token_ids)
    running = stack.worker_stats("decode-0").num_running
    assert running >= 1  # streams live on the worker we kill
    received = stack.worker_stats("decode-1").kv_bytes_received
    kv = stack.kvstore_stats()
    block_bytes = kv.used_bytes / kv.num_blocks
    # The write-back runs beside the token stream, so the kill waits for the blocks the streams had
    # filled by now (READ_BEFORE_KILL tokens: 5 full blocks past each prompt) to be stored, not lost
    # in flight: the check below is about finding them, not about the race.
    assert wait_until(lambda: stack.worker_stats("decode-0").kv_bytes_sent - sent_before
                      >= running * FILLED_BEFORE_KILL * block_bytes, timeout_s=60)
    stack.kill("decode-0")
    for tokens, stream in zip(got, streams):
        tokens.extend(_tokens(stream))  # no error: the gateway resumed the stream on decode-1
    assert [tokens == reference[(p, LONG)] for p, tokens in zip(PROMPTS, got)] == [True] * len(PROMPTS)
    # The resumed streams took their KV from the store: more blocks than all prompts hold, so
    # blocks of generated tokens (written back as they filled) were fetched, not recomputed.
    prompt_blocks = sum(len(reference[(p, 0)]) // 16 for p in PROMPTS)  # --block-size 16
    assert stack.worker_stats("decode-1").kv_bytes_received - received > prompt_blocks * block_bytes
    _all_correct(stack, reference)  # new requests go to the survivor


def test_prefill_retry_with_the_same_request_id(stack, reference):
    """A Prefill retried while the first call still runs on the same worker joins that run: both
    get the answer, nothing is pinned twice (without it the engine refuses the duplicate id)."""
    request = worker_pb2.PrefillRequest(request_id="retried-1", token_ids=_long_prompt(reference),
                                        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0))
    pinned = stack.kvstore_stats().num_pinned  # by other requests (none: the stack is idle)
    with grpc.insecure_channel(stack.child("prefill-1").spec.address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        calls = [stub.Prefill.future(request, timeout=60) for _ in range(2)]
        first, second = (c.result() for c in calls)
    assert first == second and [first.first_token] == reference[(LONG_PROMPT, 1)]
    assert stack.kvstore_stats().num_pinned == pinned + len(first.block_hashes)  # each block pinned once
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        stack.kvstore_stub(ch).Release(kvstore_pb2.ReleaseRequest(request_id="retried-1"), timeout=5)
    assert stack.kvstore_stats().num_pinned == pinned  # one Release ends the lease


def test_prefill_workers_killed(stack, reference):
    with cf.ThreadPoolExecutor(4) as pool:  # one dies under load: retried on the other
        futures = [pool.submit(lambda p: _tokens(_generate(stack, p)), PROMPTS[i % 4]) for i in range(8)]
        stack.kill("prefill-0")
        results = [f.result() for f in futures]
    assert [r == reference[(PROMPTS[i % 4], SHORT)] for i, r in enumerate(results)] == [True] * 8
    stack.kill("prefill-1")  # none left: the decode worker prefills
    _all_correct(stack, reference)


def test_gateway_killed_and_restarted(stack, reference):
    streams = [_generate(stack, p, LONG) for p in PROMPTS[:2]]
    for stream in streams:
        next(stream)  # in flight
    stack.kill("gateway")
    for stream in streams:
        with pytest.raises(grpc.RpcError) as err:
            _tokens(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.restart("gateway")
    assert _tokens(_generate(stack, PROMPTS[1], LONG)) == reference[(PROMPTS[1], LONG)]  # the retry
