"""Session prefetch end to end, with an injected clock: real kvstore (a tiny memory tier over a
real redis-server), prefill and decode workers as processes, and the gateway's request flow
in-process so that its SessionTracker runs on a clock the test moves.

After two turns with a regular gap, and other traffic that pushed the conversation out of the
kvstore's memory and out of both workers' paged caches, the prediction fires before the third
turn: the blocks are promoted from Redis into the kvstore's memory, and land in the prefill
worker's and the decode worker's paged caches; the third turn then reuses them and its output
equals the in-process engine's greedy run.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.flow import GenerationRequest
from gateway.limits import InflightLimit
from gateway.server import start_deployment
from gateway.sessions import SessionTracker
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint, resolve_model_path
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc
from redis_fixture import RedisServer, redis_server  # noqa: F401 - pytest fixture

GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _turn(flow, rid: str, prompt: str, session_id: str = "conv") -> tuple[list[int], int]:
    """(generated ids, usage.cached_tokens) of one request through the flow."""
    ids: list[int] = []
    cached = -1
    request = GenerationRequest(rid, SamplingParams(**GREEDY), prompt=prompt, session_id=session_id)
    async for chunk in flow.run(request, lambda: None):
        ids += chunk.token_ids
        if chunk.usage is not None:
            cached = chunk.usage.cached_tokens
    return ids, cached


async def _until(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


def test_session_blocks_reach_memory_prefill_and_decode_before_the_third_turn(redis_server: RedisServer,
                                                                              monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_RESIDENCY_INTERVAL_S", "0.2")
    # A 0.3 MB memory tier holds ~15 stories260K blocks (20 KiB each); 24-block paged caches.
    stack = start_stack(1, 1, "--kv-backend", redis_server.url, "--kvstore-capacity-mb", "0.3",
                        "--num-blocks", "24")
    try:
        asyncio.run(_scenario(stack, redis_server))
    finally:
        stack.stop()


async def _scenario(stack, redis: RedisServer) -> None:
    checkpoint = load_checkpoint(resolve_model_path(None))
    tok = checkpoint.tokenizer
    prefill_addr = stack.child("prefill-0").spec.address
    decode_addr = stack.child("decode-0").spec.address
    kv_addr = stack.child("kvstore").spec.address
    dep = await start_deployment("stories", None, 16, "float32", [prefill_addr], [decode_addr], kv_addr,
                                 InflightLimit(8))
    clock = Clock()
    flow = dep.flow
    flow.sessions = SessionTracker(clock, lead_s=1.0, lead_fraction=0.1, deviation_factor=0)
    flow.hot = None  # only the session signal moves blocks here
    kv_channel = grpc.aio.insecure_channel(kv_addr)
    prefill_channel = grpc.aio.insecure_channel(prefill_addr)
    kv = kvstore_pb2_grpc.KVStoreStub(kv_channel)
    prefill = worker_pb2_grpc.PrefillWorkerStub(prefill_channel)
    try:
        text = "The little dog ran to the big tree and saw a bird. The bird sang a song."
        answer, _ = await _turn(flow, "t1", text)
        clock.now += 10.0  # a regular 10 s gap
        text = tok.decode(tok.encode(text) + answer) + " Then the dog said hello."
        answer, _ = await _turn(flow, "t2", text)
        history = tok.encode(text) + answer
        chain = prompt_block_hashes(history[:-1], 16, checkpoint.fingerprint, "float32")
        full = chain[:(len(history) - 1) // 16]
        assert len(full) >= 5

        # Other traffic: the conversation leaves the kvstore's memory and both paged caches.
        for i in range(8):
            await _turn(flow, f"other{i}", f"A big red boat number {i} sailed far away over the blue sea and the"
                                           " fish swam under it all day long until the sun set behind the hill"
                                           " and the stars came out one by one over the quiet town.", "")
        kv_stats = lambda: kv.Stats(kvstore_pb2.KVStoreStatsRequest())  # noqa: E731
        backend_hits = (await kv_stats()).backend_hits

        async def decode_holds() -> int:
            reply = await kv.Lookup(kvstore_pb2.LookupRequest(block_hashes=full, with_residency=True))
            return max((w.prefix_blocks for w in reply.residency), default=0)

        await _until(lambda: _eq(decode_holds(), 0), "the decode worker's residency report shows the eviction")

        clock.now += 7.95  # predicted at +10 from the end of turn 2; lead 1 s + 10% of 10 s: due at +8
        await asyncio.sleep(0.3)
        assert await decode_holds() == 0
        clock.now += 0.1  # due now: the gateway's session task fires within a tick
        await _until(lambda: _eq(decode_holds(), len(full)), "the decode worker holds the conversation")
        reply = await prefill.Prepare(worker_pb2.PrepareRequest(request_id="probe", block_hashes=full,
                                                                signal="session"))
        assert (reply.blocks_local, reply.blocks_fetching) == (len(full), 0), "the prefill worker holds it"
        assert (await kv_stats()).backend_hits - backend_hits >= len(full), "promoted from Redis"

        redis.kill()  # from here, only the kvstore's memory tier can serve them
        got = await kv.Lookup(kvstore_pb2.LookupRequest(block_hashes=full))
        assert got.prefix_blocks == len(full), "the conversation is in the kvstore's memory"

        clock.now += 1.0
        text3 = tok.decode(history) + " They were happy."
        answer3, cached3 = await _turn(flow, "t3", text3)
        reference = Engine.from_checkpoint(checkpoint).generate([tok.encode(text3)], SamplingParams(**GREEDY))[0]
        assert answer3 == reference.output_ids
        assert cached3 >= len(full) * 16 - 16  # the re-tokenized seam may differ in its last block
    finally:
        await kv_channel.close()
        await prefill_channel.close()
        await dep.close()


async def _eq(value, expected) -> bool:
    return (await value) == expected


@pytest.fixture(autouse=True)
def _no_session_prefetch_override(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_SESSION_PREFETCH", raising=False)
