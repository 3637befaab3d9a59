"""Prefix caching across workers: the engine entry point that starts a sequence on imported
prefix blocks, and the real stack reusing a shared prefix (cached_tokens, same output as cold)."""

from __future__ import annotations

import random
import time

import grpc
import pytest

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import kvstore_pb2


@pytest.fixture(scope="module")
def hf():
    return random_hf_model("llama", seed=5)


def _run(engine, rid: str, prompt: list[int], params: SamplingParams, blocks=None) -> tuple[list[int], int]:
    """(output ids, prompt tokens whose KV was reused: shared from the cache or loaded from `blocks`)."""
    seq = engine.add(AddRequest(rid, prompt, params, blocks=blocks or {}))
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids, seq.num_cached_tokens


def test_add_with_prefix_imports_leading_blocks_and_matches_cold(make_engine, hf):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    rng = random.Random(1)
    shared = [rng.randrange(3, 160) for _ in range(50)]  # three full blocks + 2 tokens
    a, b = shared + [7, 8, 9], shared + [11, 12, 13, 14]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    cold = _run(make_engine(config, weights), "cold", b, params)[0]

    writer = make_engine(config, weights)
    _run(writer, "a", a, params)
    hashes = sorted(writer.resident())
    exported = {blk.hash: blk.data for blk in writer.export_cached(hashes)}
    assert len(exported) >= 3

    reader = make_engine(config, weights)
    out, cached = _run(reader, "b", b, params, exported)
    assert cached == 48 and out == cold
    assert reader.seqs == {}  # finished and gone
    # nothing shared: computed from scratch, still equal
    assert _run(make_engine(config, weights), "c", b, params, {}) == (cold, 0)


def test_prefix_never_covers_the_last_prompt_token(make_engine, hf):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    prompt = list(range(3, 35))  # exactly two full blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    writer = make_engine(config, weights)
    cold, _ = _run(writer, "a", prompt, params)
    blocks = {blk.hash: blk.data for blk in writer.export_cached(sorted(writer.resident()))}
    out, cached = _run(make_engine(config, weights), "b", prompt, params, blocks)
    assert cached == 16 and out == cold


def test_import_cached_blocks_are_shared_by_the_next_request(make_engine, hf):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    writer = make_engine(config, weights)
    cold, _ = _run(writer, "a", prompt, params)
    chain = writer.kv_format.full_block_hashes(prompt)
    blocks = {blk.hash: blk.data for blk in writer.export_cached(chain)}
    reader = make_engine(config, weights)
    assert reader.place(chain, blocks) == chain
    assert reader.resident() == set(chain)
    assert reader.block_manager.num_free_blocks == reader.block_manager.num_blocks  # cached, not referenced
    out, _ = _run(reader, "b", prompt, params)
    assert out == cold and reader.seqs == {}


def test_waiting_sequences_holding_imported_prefixes_do_not_deadlock(make_engine, hf):
    """Three prompts whose imported prefixes would fill a small cache while they all wait. They
    used to hold those blocks while waiting (nothing ran and the engine spun forever, then a
    heuristic unpinned them); now a waiting sequence holds nothing: the scheduler takes each
    one's KV in when it admits it, and every output equals its cold run."""
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 160) for _ in range(70)] for _ in range(3)]  # 4 full blocks + 6
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    colds = [_run(make_engine(config, weights), f"cold{i}", p, params)[0] for i, p in enumerate(prompts)]
    blocks = {}
    for i, p in enumerate(prompts):
        writer = make_engine(config, weights)
        _run(writer, "w", p, params)
        chain = writer.kv_format.full_block_hashes(p)
        blocks.update({blk.hash: blk.data for blk in writer.export_cached(chain)})

    engine = make_engine(config, weights, num_blocks=12)  # 3 x 4 imported blocks: all of it
    seqs = [engine.add(AddRequest(f"r{i}", p, params, blocks=blocks)) for i, p in enumerate(prompts)]
    assert engine.block_manager.num_free_blocks == 12  # queued, holding nothing
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_leaks()
    assert not engine.has_unfinished(), "the engine made no progress"
    assert [s.output_ids for s in seqs] == colds
    assert seqs[0].num_cached_tokens == 64  # the head took its imported prefix in


# ---- through the real stack (kvstore with a Redis tier, 1 prefill, 2 decode) -------------------

from conftest import STORIES_GGUF  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint  # noqa: E402
from pdserve.stack import start_stack  # noqa: E402
from pdserve.v1 import common_pb2, gateway_pb2  # noqa: E402
from redis_fixture import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def redis_for_stack():
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def stack(redis_for_stack):
    mp = pytest.MonkeyPatch()
    mp.setenv("PDSERVE_KV_BACKEND", redis_for_stack.url)  # `pdserve up` has no --kv-backend flag yet
    mp.setenv("PDSERVE_RESIDENCY_INTERVAL_S", "0.2")
    try:
        s = start_stack(1, 2)
    finally:
        mp.undo()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stories():
    return load_checkpoint(STORIES_GGUF)


def _generate(stub, prompt_ids_text: str, max_tokens: int = 24, session_id: str = ""):
    chunks = list(stub.Generate(gateway_pb2.GenerateRequest(
        prompt=prompt_ids_text, session_id=session_id,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))))
    return [t for c in chunks for t in c.token_ids], chunks[-1].usage


def _shared_text(tok, min_tokens: int) -> str:
    base = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
            "dog Max. One day the sun was hot and the birds were singing in the tall green trees. ")
    text = ""
    while len(tok.encode(text)) < min_tokens:
        text += base
    ids = tok.encode(text)[:min_tokens]
    return tok.decode(ids)


def test_shared_prefix_reuses_blocks_across_requests(stack, stories):
    tok = stories.tokenizer
    shared = _shared_text(tok, 300)
    a, b = shared + " Tom said hello.", shared + " The cat sat down and"
    stub = stack.gateway_stub()
    reference = Engine.from_checkpoint(stories)
    cold = reference.generate([tok.encode(b)], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]

    _, usage_a = _generate(stub, a)
    ids_b, usage_b = _generate(stub, b)
    common = 0
    for x, y in zip(tok.encode(a), tok.encode(b)):
        if x != y:
            break
        common += 1
    assert common >= 288
    assert usage_b.cached_tokens == common // 16 * 16
    assert usage_b.prompt_tokens == len(tok.encode(b))
    assert ids_b == cold.output_ids


def _stored_prefix(stack, hashes: list[bytes]) -> int:
    """Leading `hashes` the stack's kvstore holds."""
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as ch:
        reply = stack.kvstore_stub(ch).Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=5)
    return reply.prefix_blocks


def test_next_turn_reuses_written_back_answer(stack, stories):
    tok = stories.tokenizer
    stub = stack.gateway_stub()
    turn1 = "The little dog ran to the big tree and"
    ids1, _ = _generate(stub, turn1, max_tokens=64, session_id="conv-1")
    # Filled blocks are written back in the background; a person's think time is longer than
    # this wait for the conversation's full blocks (the last token has no KV yet) to be stored.
    c = stories.config
    fmt = KVFormat.named(stories.fingerprint, "float32", c.num_layers, c.num_kv_heads, c.head_dim, 16)  # the stack's
    written = fmt.full_block_hashes((tok.encode(turn1) + ids1)[:-1])
    written = written[:(len(tok.encode(turn1)) + len(ids1) - 1) // 16]
    deadline = time.monotonic() + 30
    while _stored_prefix(stack, written) < len(written) and time.monotonic() < deadline:
        time.sleep(0.05)
    turn2 = tok.decode(tok.encode(turn1) + ids1) + " Then"
    prompt2 = tok.encode(turn2)
    stable = 0  # the re-tokenized conversation may differ from the generated ids near the seam
    for x, y in zip(prompt2, tok.encode(turn1) + ids1):
        if x != y:
            break
        stable += 1
    _, usage2 = _generate(stub, turn2, max_tokens=8, session_id="conv-1")
    assert usage2.cached_tokens >= min(stable, len(tok.encode(turn1)) + len(ids1) - 1) // 16 * 16 > 16


def test_redis_killed_mid_run_then_back(stack, redis_for_stack):
    stub = stack.gateway_stub()
    errors = stack.kvstore_stats().backend_errors
    redis_for_stack.kill()
    prompts = [f"The bird number {i} flew over the little house and" for i in range(6)]
    for p in prompts:  # every request completes, served from memory
        ids, usage = _generate(stub, p, max_tokens=8)
        assert len(ids) == 8 and usage.prompt_tokens > 0
    stats = stack.kvstore_stats()
    assert stats.backend_errors > errors and not stats.backend_up
    redis_for_stack.start()
    deadline = time.monotonic() + 10  # the kvstore's monitor probes Redis every 2 s
    while not stack.kvstore_stats().backend_up and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stack.kvstore_stats().backend_up
    _generate(stub, "A new story about a frog who liked to sing very loudly in the", max_tokens=4)
