"""Pins: references on cached blocks that no sequence holds, each owned, counted by the leak check.
The PinTable on its own (exact block ids, an injected clock), then through the engine: the two
bugs of this seam that pins now rule out by construction (a prefix evicted between the lookup and
the add; a chain pinned twice by two prefetches landing together)."""

from __future__ import annotations

import random

import pytest

from conftest import model_config_from_hf, random_hf_model
from pdserve.runtime.block_manager import BlockManager, KVLeakError
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.pins import PinTable, hold_owner, request_owner
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import Sequence

BS = 4
FORMAT = KVFormat.named("0" * 32, "float32", num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cached_chain(bm: BlockManager, n_blocks: int) -> list[bytes]:
    """A finished sequence's full blocks, cached (unreferenced) in `bm`."""
    s = Sequence("warm", list(range(n_blocks * BS)), SamplingParams())
    bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)
    bm.free(s)
    return list(s.block_hashes)


def test_a_pin_references_once_per_owner_and_the_leak_check_counts_it():
    bm = BlockManager(4, FORMAT)
    pins = PinTable(bm, Clock())
    chain = _cached_chain(bm, 3)
    assert pins.pin(request_owner("r"), chain + [b"x" * 16]) == 3  # what is not resident is skipped
    assert pins.pin(request_owner("r"), chain) == 3  # again: no second reference
    assert [bm.blocks[bm.lookup(h)].ref_count for h in chain] == [1, 1, 1]
    assert pins.pin(hold_owner("session"), chain[:1], ttl_s=5) == 1  # another owner: its own
    bm.check_leaks(pinned=pins.block_ids())
    with pytest.raises(KVLeakError, match="pins"):
        bm.check_leaks()  # references nobody owns
    assert pins.unpin(request_owner("r")) == 3 and pins.unpin(request_owner("r")) == 0
    assert pins.unpin(hold_owner("session")) == 1
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3 and len(pins) == 0
    bm.check_leaks()


def test_two_prefetches_of_one_chain_hold_each_block_once():
    """Two session prefetches of one conversation landing together used to pin the chain twice
    and leak the second reference; a hold keyed by owner and hash cannot."""
    bm = BlockManager(4, FORMAT)
    clock = Clock()
    pins = PinTable(bm, clock)
    chain = _cached_chain(bm, 2)
    pins.pin(hold_owner("session"), chain, ttl_s=5)
    clock.now = 3
    pins.pin(hold_owner("session"), chain, ttl_s=5)  # the second one: extends to t = 8
    assert len(pins) == 2 and bm.num_free_blocks == 2
    clock.now = 6
    assert pins.expire() == 0
    clock.now = 8
    assert pins.expire() == 2 and bm.num_free_blocks == 4  # all released, still cached
    assert bm.num_cached_blocks == 2
    bm.check_leaks(pinned=pins.block_ids())


def test_claim_drops_the_holds_but_not_a_requests_own():
    bm = BlockManager(4, FORMAT)
    pins = PinTable(bm, Clock())
    chain = _cached_chain(bm, 2)
    pins.pin(hold_owner("session"), chain, ttl_s=5)
    pins.pin(request_owner("r"), chain[:1])
    pins.claim(set(chain))
    assert pins.holders(hold_owner("session")) == set() and pins.holders(request_owner("r")) == {chain[0]}


def test_give_up_frees_what_is_asked_soonest_to_expire_first():
    bm = BlockManager(6, FORMAT)
    pins = PinTable(bm, Clock())
    chain = _cached_chain(bm, 4)
    pins.pin(hold_owner("hot"), chain[:2], ttl_s=9)
    pins.pin(hold_owner("session"), chain[2:], ttl_s=1)
    assert pins.give_up(1) == 1
    assert pins.holders(hold_owner("session")) == {chain[3]} and len(pins.holders(hold_owner("hot"))) == 2
    pins.pin(request_owner("r"), chain[:1])  # a request's own pin is never given up
    assert pins.give_up(10) == 2  # chain[3] and chain[1]; chain[0] stays pinned by "r"
    assert len(pins) == 1


# ---- through the engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return random_hf_model("llama", seed=11)


def test_a_pinned_prefix_survives_a_step_that_needs_every_block(make_engine, hf):
    """A Prefill pins the prefix it found resident, then fetches the rest: another prompt's step in
    between used to evict it (the request then recomputed it, or read a reused block). Pinned, it
    stays, and the request is admitted on it."""
    config, weights = model_config_from_hf(hf.config, "llama"), hf.state_dict()
    engine = make_engine(config, weights, num_blocks=8)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 160) for _ in range(40)]  # two full blocks and a tail
    cold = make_engine(config, weights).generate([prompt], params)[0].output_ids
    engine.generate([prompt], params)
    prefix = engine.kv_format.reusable_hashes(prompt)
    assert engine.pin(request_owner("r"), prefix) == 2
    other = [rng.randrange(3, 160) for _ in range(6 * 16 - 2)]  # + 2 tokens: all 6 unpinned blocks
    engine.generate([other], params)  # evicts every cached block it can
    assert engine.resident() >= set(prefix)
    seq = engine.add(AddRequest("r", prompt, params))
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == 32 and seq.output_ids == cold
    assert len(engine.pins) == 0  # taken over at admission
