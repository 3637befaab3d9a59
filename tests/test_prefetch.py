"""Predictive prefetch: session think-time prediction (injected clock), hot prefixes, and the
decode worker's prefetcher counting every decision (hit, late, wasted)."""

from __future__ import annotations

import asyncio
import time
import hashlib
from types import SimpleNamespace

import pytest
import torch

from conftest import model_config_from_hf, random_hf_model
from pdserve.block_prefetch import BlockPrefetcher
from gateway.sessions import HotPrefixes, SessionTracker
from pdserve.kvwire import encode_block
from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.worker_common import KVOutage, TransferCounters
from pdserve.worker_metrics import PREFETCH_BLOCKS


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hs(*names: str) -> list[bytes]:
    return [hashlib.blake2b(n.encode(), digest_size=16).digest() for n in names]


def _count(signal: str, outcome: str) -> float:
    return PREFETCH_BLOCKS.labels(signal=signal, outcome=outcome)._value.get()


# ---- session prediction ------------------------------------------------------------------------


def test_session_think_time_ewma_and_prefetch_timing() -> None:
    clock = Clock()
    t = SessionTracker(clock, alpha=0.5, lead_s=1.0, lead_fraction=0.1, deviation_factor=0)
    assert t.arrival("s") == ""
    clock.now += 2
    t.finished("s", "w1:1", _hs("a", "b"))
    assert t.due() == []  # no gap seen yet: nothing to predict from
    clock.now += 10
    late = _count("session", "late")
    assert t.arrival("s") == "w1:1"  # the session's home worker
    assert _count("session", "late") == late  # no prediction existed: not late
    clock.now += 3
    t.finished("s", "w1:1", _hs("a", "b", "c"))
    assert t.predicted_arrival("s") == clock.now + 10
    clock.now += 7.9  # lead = 1.0 (to land) + 0.1 * 10 (margin) = 2.0: due at +8
    assert t.due() == []
    clock.now += 0.2
    [plan] = t.due()
    assert plan.worker == "w1:1" and plan.block_hashes == tuple(_hs("a", "b", "c"))
    assert t.due() == []  # once per turn
    clock.now += 2
    t.arrival("s")  # gap 10.1: EWMA 0.5 * 10.1 + 0.5 * 10
    clock.now += 1
    t.finished("s", "w2:2", _hs("a"))
    assert t.predicted_arrival("s") == pytest.approx(clock.now + 10.05)


def test_arrival_before_the_prediction_fires_counts_late() -> None:
    clock = Clock()
    t = SessionTracker(clock, lead_s=0.5, deviation_factor=0)
    t.arrival("s")
    t.finished("s", "w", _hs("a"))
    clock.now += 5
    t.arrival("s")
    t.finished("s", "w", _hs("a", "b", "c"))
    late = _count("session", "late")
    clock.now += 1  # predicted at +5, prefetch due at +4.5: the user was quicker
    assert t.due() == []
    t.arrival("s")
    assert _count("session", "late") == late + 3


def test_irregular_sessions_are_prefetched_earlier() -> None:
    """The lead grows with the think time's mean deviation (EWMA, as TCP's RTTVAR)."""
    clock = Clock()
    t = SessionTracker(clock, alpha=0.5, lead_s=0.1, lead_fraction=0.0, deviation_factor=2.0)
    t.arrival("s")
    for gap in (10.0, 4.0, 7.0):  # mean 10 -> 7 -> 7; deviation 0 -> 0.5*6 = 3 -> 0.5*0 + 0.5*3 = 1.5
        t.finished("s", "w", _hs("a"))
        clock.now += gap
        t.arrival("s")
    t.finished("s", "w", _hs("a", "b"))
    assert t.predicted_arrival("s") == pytest.approx(clock.now + 7.0)
    clock.now += 7.0 - 3.1 - 0.01  # lead 0.1 + 2 x 1.5 = 3.1
    assert t.due() == []
    clock.now += 0.02
    [plan] = t.due()
    assert plan.block_hashes == tuple(_hs("a", "b"))


def test_a_new_session_borrows_the_population_think_time() -> None:
    """A session's second turn is predicted too: from the gaps other sessions showed."""
    clock = Clock()
    t = SessionTracker(clock, lead_s=0.5, lead_fraction=0.0, deviation_factor=0)
    t.arrival("old")
    t.finished("old", "w", _hs("x"))
    clock.now += 4
    t.arrival("old")
    t.finished("old", "w", _hs("x", "y"))
    t.arrival("new")
    t.finished("new", "w2", _hs("n"))
    assert t.predicted_arrival("new") == pytest.approx(clock.now + 4)
    clock.now += 3.4
    assert [p.session_id for p in t.due()] == []
    clock.now += 0.2  # 0.5 s before the 4 s the population thinks
    assert sorted(p.session_id for p in t.due()) == ["new", "old"]


def test_quiet_sessions_are_given_up_and_forgotten() -> None:
    clock = Clock()
    t = SessionTracker(clock, give_up_factor=3.0, lead_s=0.5, forget_after_s=100)
    t.arrival("s")
    t.finished("s", "w", _hs("a"))
    clock.now += 2
    t.arrival("s")
    t.finished("s", "w", _hs("a", "b"))
    clock.now += 7  # past 3 think times without having been due in between
    assert t.due() == []
    clock.now += 1
    assert t.due() == []  # given up: no prefetch for this turn any more
    clock.now += 200
    t.due()
    assert t.predicted_arrival("s") is None  # forgotten


# ---- hot prefixes -----------------------------------------------------------------------------


def test_hot_prefix_after_enough_requests_goes_to_workers_lacking_it() -> None:
    clock = Clock()
    hot = HotPrefixes(clock, min_requests=3, window_s=10, chain_blocks=2, resend_s=5)
    chain = _hs("p1", "p2", "x")
    assert hot.observe(chain) is None and hot.observe(chain) is None
    key = hot.observe(chain)
    assert key == tuple(chain[:2])
    assert hot.targets(key, ["w1", "w2", "w3"], {"w1": 2, "w2": 1}) == ["w2", "w3"]
    assert hot.targets(key, ["w1", "w2", "w3"], {}) == ["w1"]  # w2, w3 told recently
    clock.now += 6
    assert hot.targets(key, ["w2"], {}) == ["w2"]
    clock.now += 20  # the window passed: cold again
    assert hot.observe(chain) is None
    assert hot.observe(_hs("short")) is None  # one block: not worth it


# ---- the decode worker's prefetcher ------------------------------------------------------------


def _engine(num_blocks: int = 64):
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine

    hf = random_hf_model("llama", seed=3)
    return Engine(model_config_from_hf(hf.config, "llama"), hf.state_dict(), "e" * 32,
                  EngineConfig(cache=CacheConfig(num_blocks=num_blocks)))


@pytest.fixture(scope="module")
def engine():
    return _engine()


class FakeKV:
    def __init__(self, blocks: dict[bytes, bytes], delay_s: float = 0.0) -> None:
        self.blocks, self.delay_s = blocks, delay_s

    async def get_blocks(self, hashes, request_id=""):
        await asyncio.sleep(self.delay_s)
        return [self.blocks.get(h) for h in hashes]


@pytest.fixture
def make_worker():
    """A worker's parts around a real AsyncEngine (its thread stopped after the test); the
    kvstore is a dict (FakeKV): what is tested is the prefetcher's bookkeeping."""
    started: list[AsyncEngine] = []

    def factory(engine, kv) -> SimpleNamespace:
        aengine = AsyncEngine(engine, batch_window_s=0).start()
        started.append(aengine)
        return SimpleNamespace(kv=kv, kv_format=engine.kv_format, counters=TransferCounters(), aengine=aengine,
                               kv_outage=KVOutage(), mac_key=b"")
    yield factory
    for aengine in started:
        aengine.stop()


def _chain_blocks(engine, tokens: list[int]) -> tuple[list[bytes], dict[bytes, bytes]]:
    fmt = engine.kv_format
    chain = fmt.full_block_hashes(tokens)
    data = {h: encode_block(torch.full(fmt.shape, float(i)), fmt, 16) for i, h in enumerate(chain)}
    return chain, data


async def _until(condition, timeout_s: float = 30.0) -> None:
    """Until `condition()` holds (the engine thread acts between its loop turns), or fail."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert condition(), "condition not reached before the deadline"


async def _settled(p: BlockPrefetcher, timeout_s: float = 30.0) -> None:
    """Until every prefetch started so far has landed (a fixed sleep is too short on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while p._inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not p._inflight, "prefetches still in flight"


def test_prefetcher_counts_hits_late_and_waste(engine, make_worker) -> None:
    async def scenario() -> None:
        chain, data = _chain_blocks(engine, list(range(3, 3 + 64)))
        p = BlockPrefetcher(make_worker(engine, FakeKV(data)), max_staged_blocks=2)
        before = {o: _count("dispatch", o) for o in ("hit", "late", "wasted")}
        p.prefetch(chain[:3])
        await _settled(p)
        assert _count("dispatch", "wasted") - before["wasted"] == 1  # staging holds 2: one dropped
        got = await p.gather("r", chain[:3])
        assert set(got) == set(chain[:3])
        assert _count("dispatch", "hit") - before["hit"] == 2

        p.worker.kv.delay_s = 0.1
        p.prefetch([chain[3]])
        await p.gather("r2", [chain[3]])  # still on its way when Decode came
        assert _count("dispatch", "late") - before["late"] == 1
        assert _count("dispatch", "hit") - before["hit"] == 3

    asyncio.run(scenario())


def test_session_prefetch_lands_in_the_paged_cache(engine, make_worker) -> None:
    async def scenario() -> None:
        chain, data = _chain_blocks(engine, list(range(100, 100 + 48)))
        p = BlockPrefetcher(make_worker(engine, FakeKV(data)))
        hits, wasted = _count("session", "hit"), _count("session", "wasted")
        p.prefetch(chain, "session")
        await _settled(p)
        assert all(p.is_local(h) for h in chain)
        assert await p.gather("r", chain[:2]) == {}  # local already: nothing to fetch
        assert _count("session", "hit") - hits == 2
        p.evicted([chain[2]])  # evicted before anyone used it
        assert _count("session", "wasted") - wasted == 1
        with pytest.raises(ValueError, match="signal"):
            p.prefetch(chain, "psychic")

    asyncio.run(scenario())


def test_gather_counts_where_each_needed_block_was(engine, make_worker) -> None:
    """The decode hit rate's inputs: resident, brought by a signal, late, fetched, missing."""
    async def scenario() -> None:
        chain, data = _chain_blocks(engine, list(range(200, 200 + 96)))  # 6 blocks
        p = BlockPrefetcher(make_worker(engine, FakeKV({h: d for h, d in data.items() if h != chain[5]})))
        p.prefetch(chain[:2], "session")
        await _settled(p)
        p._promoted.pop(chain[0])  # as if it had been in the paged cache all along
        p.prefetch([chain[2]])  # dispatch: staged
        await _settled(p)
        p.worker.kv.delay_s = 0.05
        p.prefetch([chain[3]])  # still on its way when Decode comes
        await p.gather("r", chain)
        assert p.sources == {"resident": 1, "session": 1, "hot": 0, "dispatch": 1, "late": 1,
                             "fetched": 1, "missing": 1}

    asyncio.run(scenario())


def test_session_prefetch_off_keeps_session_routing() -> None:
    from gateway.flow import RequestFlow

    flow = RequestFlow(SimpleNamespace(), None, None, None, None, hot=HotPrefixes(), session_prefetch=False)
    assert flow.sessions is not None and not flow.session_prefetch
    flow.sessions.arrival("s")
    flow.sessions.finished("s", "decode-1:5", [b"h"])
    assert flow._session_arrival("s") == "decode-1:5"  # the next turn goes back to its worker
    assert flow._session_task is None  # but nothing is prefetched


def test_held_session_blocks_survive_until_claimed_expired_or_needed(make_worker) -> None:
    """With hold_s (the prefill worker), a session prefetch has the engine hold its whole chain:
    not evictable until a request is admitted on it, its hold expires, or a prompt that runs now
    needs the room (the scheduler gives up the soonest-expiring holds)."""
    engine = _engine(num_blocks=16)
    clock = Clock()
    engine.pins.clock = clock
    bm = engine.block_manager
    params = SamplingParams(max_tokens=1, temperature=0)

    async def scenario() -> None:
        chain_tokens = [3 + i % 150 for i in range(64)]
        chain, data = _chain_blocks(engine, chain_tokens)  # 4 blocks
        other, other_data = _chain_blocks(engine, [100 + i % 50 for i in range(32)])  # 2 blocks
        worker = make_worker(engine, FakeKV({**data, **other_data}))
        p = BlockPrefetcher(worker, clock=clock, hold_s=5.0, signals=("session",))
        p.prefetch(chain, "session")
        await _settled(p)
        await _until(lambda: bm.num_free_blocks == 12)  # pinned, not evictable
        assert all(p.is_local(h) for h in chain)
        async for _ in worker.aengine.generate(AddRequest("r", chain_tokens[:33], params)):
            pass  # a request admitted on the first two blocks: their holds end
        await _until(lambda: bm.num_free_blocks == 14)
        clock.now += 6  # the turn never came for the rest: evictable again (still cached)
        await _until(lambda: bm.num_free_blocks == 16)
        assert all(p.is_local(h) for h in chain)

        p.prefetch(other, "session")
        await _settled(p)
        await _until(lambda: bm.num_free_blocks == 14)
        prompt = [150 + i % 9 for i in range(15 * 16 - 1)]  # + its token: 15 blocks, one more than free
        async for _ in worker.aengine.generate(AddRequest("big", prompt, params)):
            pass
        assert bm.num_free_blocks == 15  # one hold was given up for it, the other kept
        clock.now += 6
        await _until(lambda: bm.num_free_blocks == 16)
        await worker.aengine.check_leaks()

    asyncio.run(scenario())
