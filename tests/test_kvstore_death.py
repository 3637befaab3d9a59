"""The KV store and its Redis tier SIGKILLed under load (docs/reliability.md): every request completes
with the in-process engine's greedy output (workers compute the KV they cannot fetch); a kvstore
restarted on its port finds its blocks again in Redis and the workers use it without restarting; a
restarted (empty) Redis is refilled from the kvstore's memory, so a later kvstore restart still finds
them. Every wait is a condition with a deadline: the test means the same on a faster or slower machine."""

from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import pytest
import redis
import torch

from conftest import STORIES_GGUF
from kvstore.redis_tier import block_key
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, kvstore_pb2
from redis_fixture import redis_server_module  # noqa: F401
from waiting import wait_until

PROMPTS = (
    "Once upon a time, in a small town, there lived a kind old man who",
    "Lily and Ben went to the park to play with a ball. They",
    "The little dog was sad because it lost its red",
    "One day a big bird flew over the sea and saw a",
)
STORED = "A girl named Sue had a big red ball and a small blue car that she loved to"
TOKENS = 160
READ_BEFORE_KILL = 24
DEADLINE_S = 60.0  # for things that happen in the background (write-back, reconnects, back-offs)


@pytest.fixture(scope="module")
def checkpoint():
    torch.set_num_threads(1)  # the stack's processes use the other cores; more threads thrash
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """{prompt: greedy output ids} of the in-process engine."""
    prompts = (*PROMPTS, STORED)
    ids = [checkpoint.tokenizer.encode(p) for p in prompts]
    seqs = Engine.from_checkpoint(checkpoint).generate(
        ids, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    return {p: s.output_ids for p, s in zip(prompts, seqs)}


@pytest.fixture(scope="module")
def stack(redis_server_module):  # noqa: F811
    s = start_stack(1, 1, "--kv-backend", redis_server_module.url, "--disagg-policy", "always-remote")
    yield s
    s.stop()


def _generate(stack, prompt: str):
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    return stack.gateway_stub().Generate(request, timeout=120)


def _tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def _run_through(stack, reference, kill) -> None:
    """Streams of every prompt are mid-way when `kill()` runs; each completes equal to the reference."""
    streams = [_generate(stack, p) for p in PROMPTS]
    got: list[list[int]] = [[] for _ in streams]
    for tokens, stream in zip(got, streams):
        while len(tokens) < READ_BEFORE_KILL:
            tokens.extend(next(stream).token_ids)
    kill()
    for tokens, stream in zip(got, streams):
        tokens.extend(_tokens(stream))
    assert [tokens == reference[p] for p, tokens in zip(PROMPTS, got)] == [True] * len(PROMPTS)
    with cf.ThreadPoolExecutor(4) as pool:  # new requests during the outage
        results = list(pool.map(lambda p: _tokens(_generate(stack, p)), PROMPTS))
    assert [r == reference[p] for p, r in zip(PROMPTS, results)] == [True] * len(PROMPTS)


def _stored_prefix(stack, hashes: list[bytes]) -> int:
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        reply = stack.kvstore_stub(ch).Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=5)
    return reply.prefix_blocks


def _await(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll `condition()` until it holds; fail naming `what` at the deadline."""
    assert wait_until(condition, deadline_s), f"{what}: not within {deadline_s:g} s"


def _await_stored(stack, hashes: list[bytes]) -> int:
    """Leading blocks of `hashes` the store holds, once all are there or at the deadline (the
    write-back and Redis write-through run in the background)."""
    wait_until(lambda: _stored_prefix(stack, hashes) >= len(hashes), DEADLINE_S)
    return _stored_prefix(stack, hashes)


def _stored_hashes(stack, checkpoint, reference) -> list[bytes]:
    """STORED's blocks once generated: its prompt and written-back answer (all in the store)."""
    assert _tokens(_generate(stack, STORED)) == reference[STORED]
    ids = checkpoint.tokenizer.encode(STORED) + reference[STORED][:-1]  # prompt + answer with KV
    return prompt_block_hashes(ids, 16, checkpoint.fingerprint, "float32")


def test_kvstore_killed_under_load_then_restarted(stack, reference, checkpoint):
    hashes = _stored_hashes(stack, checkpoint, reference)
    assert _await_stored(stack, hashes) == len(hashes)  # prompt and written-back answer blocks
    _run_through(stack, reference, lambda: stack.kill("kvstore"))
    stack.restart("kvstore")
    assert _await_stored(stack, hashes) == len(hashes)  # found again, in Redis
    assert _puts_resume(stack) > 0  # the workers' clients reconnected without a restart
    assert _tokens(_generate(stack, STORED)) == reference[STORED]


def _puts_resume(stack) -> int:
    """Send new prompts until their KV blocks reach the (restarted) store, or the deadline; the puts
    it counted. Each worker redials the store at least every 2 s (grpc_server.RECONNECT_OPTIONS)."""
    deadline = time.monotonic() + DEADLINE_S
    i = 0
    while not (puts := stack.kvstore_stats().puts) and time.monotonic() < deadline:
        _tokens(_generate(stack, f"Tom saw {i} frogs that could jump very high, so he"))
        i += 1
    return puts


def _in_redis(server, hashes: list[bytes]) -> int:
    return redis.Redis(port=server.port).exists(*[block_key(h) for h in hashes])


def _read_into_memory(stack, hashes: list[bytes]) -> int:
    """GetBlocks without a lease: blocks only Redis held (the kvstore restarted since they were put)
    are promoted into its memory tier, the copy a refill writes back. The blocks it returned."""
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        blocks = stack.kvstore_stub(ch).GetBlocks(kvstore_pb2.GetBlocksRequest(block_hashes=hashes), timeout=30)
        return sum(not b.missing for b in blocks)


def test_redis_killed_and_restarted_under_load(stack, reference, checkpoint, redis_server_module):  # noqa: F811
    hashes = _stored_hashes(stack, checkpoint, reference)
    _await(lambda: _in_redis(redis_server_module, hashes) == len(hashes), "STORED written through to Redis")
    assert _read_into_memory(stack, hashes) == len(hashes)
    _run_through(stack, reference, redis_server_module.kill)
    redis_server_module.start()  # empty: no persistence
    _run_through(stack, reference, lambda: None)
    # The tier retries after its back-off (and its monitor probes every 2 s): a condition, not a sleep.
    _await(lambda: stack.kvstore_stats().backend_up, "kvstore's Redis tier back up")
    _await(lambda: _in_redis(redis_server_module, hashes) == len(hashes), "STORED refilled into the new Redis")
    stack.kill("kvstore")
    stack.restart("kvstore")  # an empty memory tier: everything it finds comes from the refilled Redis
    assert _await_stored(stack, hashes) == len(hashes)
