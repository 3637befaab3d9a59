"""The disaggregated stack, all real processes over gRPC on loopback, against the in-process engine."""

from __future__ import annotations

import concurrent.futures as cf
import os
from pathlib import Path

import grpc
import pytest

from waiting import wait_until
from conftest import STORIES_GGUF
from pdserve import thread_policy
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, kvstore_pb2
from pdserve.stack import start_stack

PROMPTS = [
    "Once upon a time",
    "Tom had a red ball.",
    "The sun was hot and the birds were singing in the tall green trees. A little",
    "Lily",
    "One day, a big dog named Max went to the park with his friend, a small cat. They played",
    "Sam was sad because his toy was broken. His mom said",
    "The bird flew high",
    "There was a little boat on the lake. It was blue and",
]


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def stack():
    s = start_stack(prefill=2, decode=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy outputs of the in-process engine: what the stack must reproduce."""
    engine = Engine.from_checkpoint(checkpoint)

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        return engine.generate([prompt_ids], params)[0].output_ids

    return run


def greedy(max_tokens: int = 40, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def collect(stream) -> tuple[list[int], str, list[gateway_pb2.GenerateResponse]]:
    chunks = list(stream)
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks


def test_generate_equals_in_process_engine(stack, checkpoint, reference):
    stub = stack.gateway_stub()
    tok = checkpoint.tokenizer
    for prompt in PROMPTS:
        ids, text, chunks = collect(stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, sampling=greedy())))
        expected = reference(tok.encode(prompt), 40)
        assert ids == expected, prompt
        assert text == tok.decode(tok.encode(prompt) + expected)[len(tok.decode(tok.encode(prompt))):]
        last = chunks[-1]
        assert last.finish_reason in ("stop", "length")
        assert last.usage.prompt_tokens == len(tok.encode(prompt))
        assert last.usage.completion_tokens == len(ids)
        assert all(not c.finish_reason for c in chunks[:-1])


def test_chat_equals_in_process_engine(stack, checkpoint, reference):
    stub = stack.gateway_stub()
    tok = checkpoint.tokenizer
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        request = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                                          sampling=greedy(24))
        ids, _, _ = collect(stub.Chat(request))
        assert ids == reference(tok.encode(tok.apply_chat_template(messages)), 24), prompt


def test_32_concurrent_streams_are_correct_and_batched(stack, checkpoint, reference):
    tok = checkpoint.tokenizer
    prompts = [f"{PROMPTS[i % 8]} {i}" for i in range(32)]
    stub = stack.gateway_stub()
    before = {n: stack.worker_stats(n).batch_size_counts for n in ("decode-0", "decode-1")}

    def run(prompt: str) -> list[int]:
        return collect(stub.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, sampling=greedy(48, ignore_eos=True))))[0]

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, prompts))
    for prompt, ids in zip(prompts, results):
        assert ids == reference(tok.encode(prompt), 48), prompt
    batched = 0
    for name in ("decode-0", "decode-1"):
        after = stack.worker_stats(name).batch_size_counts
        batched += sum(n for size, n in after.items() if size > 1 and n > before[name].get(size, 0))
    assert batched > 0, "no decode step ran with more than one sequence"


def test_cancel_mid_stream_frees_kv_everywhere(stack):
    stub = stack.gateway_stub()
    call = stub.Generate(gateway_pb2.GenerateRequest(
        prompt=PROMPTS[2], sampling=greedy(400, ignore_eos=True)))
    received = 0
    for chunk in call:
        received += len(chunk.token_ids)
        if received >= 5:
            call.cancel()
            break
    assert received >= 5

    def idle() -> bool:
        decodes = [stack.worker_stats(n) for n in ("decode-0", "decode-1")]
        kv = stack.kvstore_stats()
        return (all(d.num_running == 0 and d.num_waiting == 0 for d in decodes)
                and all(d.num_blocks_free == d.num_blocks_total for d in decodes)
                and kv.num_pinned == 0 and kv.num_leases == 0)

    assert wait_until(idle), (stack.kvstore_stats(), [stack.worker_stats(n) for n in ("decode-0", "decode-1")])


@pytest.mark.parametrize("after_chunks", [0, 1])
def test_cancel_before_decode_releases_the_kvstore_lease(stack, after_chunks):
    # Found by `pdserve soak`: a client cancel at once or after the first token (prefill's) left the
    # blocks prefill had put pinned in the kvstore until the lease TTL (120 s).
    stub = stack.gateway_stub()
    for i in range(6):
        call = stub.Generate(gateway_pb2.GenerateRequest(prompt=f"{PROMPTS[4]} {i}", sampling=greedy(40)))
        try:
            if after_chunks == 0:
                call.cancel()
            for _ in call:
                call.cancel()
                break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err
    stats = stack.kvstore_stats
    assert wait_until(lambda: stats().num_leases == 0 and stats().num_pinned == 0), stats()


def test_corrupted_kv_block_is_detected_and_recomputed(stack, checkpoint, reference):
    tok, c = checkpoint.tokenizer, checkpoint.config
    prompt = "A corrupted block must never reach the model: the little girl smiled and said"
    ids = tok.encode(prompt)
    first_hash = prompt_block_hashes(ids, 16, checkpoint.fingerprint, "float32")[0]
    spec = KVFormat(checkpoint.fingerprint, __import__("torch").float32, c.num_layers, c.num_kv_heads,
                     c.head_dim, 16)
    import torch

    data = bytearray(encode_block(torch.randn(spec.shape), spec, 16))
    data[-7] ^= 0x40  # one flipped bit in the payload: only the checksum can tell
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        put = stack.kvstore_stub(ch).PutBlocks(iter([kvstore_pb2.PutBlockRequest(
            block_hash=first_hash, data=bytes(data))]))
        assert put.stored == 1
    got, _, _ = collect(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=greedy(30))))
    assert got == reference(ids, 30)


@pytest.mark.parametrize("request_kwargs, fragment", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(max_tokens=100000)}, "context window"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(top_p=0)}, "top_p"),
    ({"prompt": "hi", "sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p"),
])
def test_bad_generate_requests_are_invalid_argument(stack, request_kwargs, fragment):
    with pytest.raises(grpc.RpcError) as err:
        collect(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details()


def test_unknown_chat_role_is_invalid_argument_and_the_stack_keeps_serving(stack, checkpoint, reference):
    stub = stack.gateway_stub()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Chat(gateway_pb2.ChatRequest(
            messages=[gateway_pb2.ChatMessage(role="wizard", content="hi")], sampling=greedy())))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "wizard" in err.value.details()
    ids, _, _ = collect(stub.Generate(gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(10))))
    assert ids == reference(checkpoint.tokenizer.encode(PROMPTS[0]), 10)


def test_deadline_exceeded_is_honoured(stack):
    stub = stack.gateway_stub()
    with pytest.raises(grpc.RpcError) as err:
        collect(stub.Generate(gateway_pb2.GenerateRequest(
            # 1800 tokens (near the 2048-token window): far longer than 0.3 s even on a 4x faster machine.
            prompt=PROMPTS[0], sampling=greedy(1800, ignore_eos=True)), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_gateway_and_the_kvstore_run_without_torch(stack):
    """Neither holds a tensor: the gateway names blocks (runtime.block_names) and reads the model's
    header, the KV store checks block headers (pdserve.kv_header). Their processes map no torch
    library (~1.4 s of each start and ~200 MB) after serving a request, seeded sampling included; a
    worker's does, so the check sees it."""
    ids, _, _ = collect(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt=PROMPTS[0], sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))))
    assert len(ids) == 8

    def maps(name: str) -> str:
        return Path(f"/proc/{stack.child(name).proc.pid}/maps").read_text()

    assert "libtorch" in maps("prefill-0")
    assert "libtorch" not in maps("kvstore")
    assert "libtorch" not in maps("gateway")


def test_a_port_taken_before_the_gateway_binds_it_starts_the_stack_again(monkeypatch):
    """The gRPC port start_stack picks is bound only once the workers serve; taken by then (here by
    this test), the gateway cannot bind it and the stack starts again on new ports."""
    import socket

    import pdserve.stack as stack_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real_free_port = stack_module.free_port
    monkeypatch.setattr(stack_module, "free_port", lambda *a, **k: next(picks, None) or real_free_port(*a, **k))
    try:
        s = start_stack(1, 1)
        try:
            assert s.gateway_address != f"127.0.0.1:{taken.getsockname()[1]}"
            [chunk, *_] = list(s.gateway_stub().Generate(gateway_pb2.GenerateRequest(
                prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0)), timeout=60))
            assert chunk.token_ids
        finally:
            s.stop()
    finally:
        taken.close()


def _threads(pid: int) -> list[tuple[str, int]]:
    """(name, scheduling policy) of each thread of process `pid` (/proc: comm, and stat's 41st field)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            out.append(((task / "comm").read_text().strip(), int(stat.rsplit(")", 1)[1].split()[38])))
        except (OSError, IndexError):  # the thread ended between listing and reading
            continue
    return out


def test_the_gateway_and_kvstore_threads_run_under_sched_batch_and_the_workers_do_not(stack):
    """pdserve.thread_policy's defaults: every thread of the gateway and the kvstore is SCHED_BATCH
    (their wake-ups do not preempt an engine's OpenMP team mid-step); a worker's threads keep the
    default policy, its engine thread and team under their own name."""
    ids, _, _ = collect(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt=PROMPTS[0], sampling=greedy(8, ignore_eos=True))))
    assert len(ids) == 8
    for name in ("gateway", "kvstore"):
        threads = _threads(stack.child(name).proc.pid)
        assert threads and {policy for _, policy in threads} == {os.SCHED_BATCH}, (name, threads)
    for name in ("prefill-0", "decode-0"):
        threads = _threads(stack.child(name).proc.pid)
        assert {policy for _, policy in threads} == {os.SCHED_OTHER}, (name, threads)
        assert thread_policy.COMPUTE_THREAD_NAME in {comm for comm, _ in threads}, (name, threads)
