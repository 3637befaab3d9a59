"""Prefill in one engine, decode in another: the same tokens as one engine doing both."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.kvwire import decode_block, encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.pins import request_owner
from pdserve.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf():
    return random_hf_model("llama", seed=21)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 160) for _ in range(n)] for n in (5, 16, 29, 48)]


def _spec(engine) -> KVFormat:
    return engine.kv_format


def _prefill(engine, prompts, params) -> list[tuple[int, dict[bytes, bytes], list[bytes]]]:
    """Prefill role: first token plus the prompt's blocks, wire-encoded."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, hold_blocks=True)
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts[out.request_id] = out.new_token_ids[0]
    results = []
    for i in range(len(prompts)):
        blocks = engine.export_held(f"r{i}")
        engine.release_held(f"r{i}")
        wire = {b.hash: encode_block(b.data, _spec(engine), b.num_tokens) for b in blocks}
        results.append((firsts[f"r{i}"], wire, [b.hash for b in blocks]))
    return results


def _decode(engine, prompts, prefilled, params, drop: set[int] = frozenset()) -> list[list[int]]:
    seqs = []
    for i, (p, (first, wire, hashes)) in enumerate(zip(prompts, prefilled)):
        blocks = {h: decode_block(d, _spec(engine))[0] for j, (h, d) in enumerate(wire.items()) if j not in drop}
        engine.add(AddRequest(f"d{i}", p, params, blocks=blocks, first_token=first, prompt_hashes=hashes))
        seqs.append(engine.seqs[f"d{i}"])
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_disaggregated_equals_in_process(make_engine, hf, params):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    prompts = _prompts()
    expected = [s.output_ids for s in make_engine(config, weights).generate(prompts, params)]
    prefilled = _prefill(make_engine(config, weights), prompts, params)
    assert _decode(make_engine(config, weights), prompts, prefilled, params) == expected


def test_missing_block_falls_back_to_recompute(make_engine, hf):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts()
    expected = [s.output_ids for s in make_engine(config, weights).generate(prompts, params)]
    prefilled = _prefill(make_engine(config, weights), prompts, params)
    decoder = make_engine(config, weights)
    assert _decode(decoder, prompts, prefilled, params, drop={0}) == expected


def test_decode_worker_shares_blocks_it_already_holds(make_engine, hf):
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(3, 40))  # two full blocks and a tail
    prefilled = _prefill(make_engine(config, weights), [prompt, prompt], params)
    decoder = make_engine(config, weights)
    first = _decode(decoder, [prompt], prefilled[:1], params)
    free_before = decoder.block_manager.num_free_blocks
    cached_before = decoder.block_manager.num_cached_blocks
    assert cached_before >= 2
    assert _decode(decoder, [prompt], prefilled[1:], params) == first
    assert decoder.block_manager.num_free_blocks == free_before


@pytest.mark.parametrize("order", ["add_then_cleanup", "cleanup_then_never_added"])
def test_request_pins_are_released_exactly_once(make_engine, hf, order):
    """A Prefill's pins on cached prefix blocks: its sequence takes them over (dropped when the
    scheduler admits it), and the cleanup that runs after the add (or instead of it, on a
    cancel) drops them only if the sequence never took them."""
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    params = SamplingParams(max_tokens=1, temperature=0)
    prompt = list(range(3, 40))  # two full blocks and a tail
    engine.generate([prompt], params)  # its two full blocks are cached now
    owner = request_owner("r")
    assert engine.pin(owner, engine.kv_format.reusable_hashes(prompt)) == 2
    bm = engine.block_manager
    assert bm.num_cached_blocks == 0  # referenced by the pins
    engine.check_leaks()  # the pins are owned references
    if order == "add_then_cleanup":
        engine.add(AddRequest("r", prompt, params, hold_blocks=True))
        assert engine.unpin(owner) == 0  # queued: the sequence owns them now
        assert len(engine.pins) == 2
        engine.step()  # admitted: its block table references them, the pins are gone
        assert len(engine.pins) == 0
        while engine.has_unfinished():
            engine.step()
        engine.release_held("r")
    engine.unpin(owner)  # the cleanup: a no-op after the admission, the release after a cancel
    engine.unpin(owner)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks >= 2
    engine.check_leaks()


def test_queued_request_aborted_drops_its_pins(make_engine, hf):
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    params = SamplingParams(max_tokens=1, temperature=0)
    prompt = list(range(3, 40))
    engine.generate([prompt], params)
    engine.pin(request_owner("r"), engine.kv_format.reusable_hashes(prompt))
    engine.add(AddRequest("r", prompt, params, hold_blocks=True))
    engine.abort("r")
    assert len(engine.pins) == 0 and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.check_leaks()


def test_decode_uses_the_prefix_it_can_get_when_a_later_block_is_missing(make_engine, hf):
    """A prefilled request whose third block is missing shares/loads the first two and computes
    the rest; the output still equals the in-process run."""
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(3, 60))  # three full blocks and a tail
    expected = make_engine(config, weights).generate([prompt], params)[0].output_ids
    [(first, wire, hashes)] = _prefill(make_engine(config, weights), [prompt], params)
    decoder = make_engine(config, weights)
    blocks = {h: decode_block(d, _spec(decoder))[0] for h, d in wire.items() if h != hashes[2]}
    seq = decoder.add(AddRequest("d", prompt, params, blocks=blocks, first_token=first, prompt_hashes=hashes))
    assert decoder.block_manager.num_free_blocks == decoder.block_manager.num_blocks  # waiting: holds nothing
    decoder.step()
    assert seq.num_cached_tokens == 32 and seq.external is None  # two blocks loaded at admission
    while decoder.has_unfinished():
        decoder.step()
    assert seq.output_ids == expected
    decoder.check_leaks()


def test_a_partial_blocks_rows_past_the_prompt_leave_as_zeros(make_engine, hf):
    """A prompt's tail block may be one another sequence wrote and freed: its rows past the prompt
    must not leave the engine (they would travel to the kvstore under this prompt's hash)."""
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    used = make_engine(config, weights, num_blocks=6)
    used.generate([_prompts()[3]], greedy)  # 88 tokens: every block written; 5 full ones cached
    assert used.kv_cache.abs().amax(dim=(1, 2, 3, 4, 5)).count_nonzero() == 6
    fresh = make_engine(config, weights, num_blocks=6)
    prompt = _prompts()[2]  # 29 tokens: a full block and a 13-token tail
    once = SamplingParams(max_tokens=1, temperature=0)
    exported = {}
    for name, engine in (("used", used), ("fresh", fresh)):
        engine.add_request("p", prompt, once, hold_blocks=True)
        while engine.has_unfinished():
            engine.step()
        exported[name] = engine.export_held("p")
        engine.release_held("p")
    tail = exported["used"][-1]
    assert tail.num_tokens == 13 and not tail.data[:, :, 13:].any()
    for a, b in zip(exported["used"], exported["fresh"], strict=True):
        assert a.hash == b.hash and torch.equal(a.data, b.data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_block_copy_equals_torch_copy_in_every_kv_dtype(dtype):
    from pdserve.runtime.kv_transfer import clone_block, copy_block

    cache = torch.randn(4, 3, 2, 16, 2, 8).to(dtype)  # [blocks, layers, 2, rows, KVH, D]
    src = torch.randn(3, 2, 16, 2, 8).to(dtype)
    reference = cache.clone()
    reference[2].copy_(src)
    copy_block(cache[2], src)
    assert torch.equal(cache.view(torch.uint8), reference.view(torch.uint8))  # bytes: fp8 has no ==
    copied = clone_block(cache[1])
    assert copied.data_ptr() != cache[1].data_ptr()
    assert torch.equal(copied.view(torch.uint8), cache[1].view(torch.uint8))


def test_block_copy_takes_torch_copy_for_a_strided_or_converting_block():
    from pdserve.runtime.kv_transfer import copy_block

    dst = torch.zeros(2, 4, 8)
    strided = torch.randn(2, 8, 4).transpose(1, 2)  # not contiguous
    copy_block(dst, strided)
    assert torch.equal(dst, strided)
    halves = torch.randn(2, 4, 8).to(torch.bfloat16)
    copy_block(dst, halves)  # bf16 into fp32: converted, as copy_ does
    assert torch.equal(dst, halves.float())
