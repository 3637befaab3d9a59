"""The scheduler without a model: fake sequences (token ids only), exact SchedulerOutputs, block
ids, preemption order, chunk splits under the token budget, and KV from elsewhere brought in at
admission (with the prefetch holds giving way). The engine's step is simulated by marking the
scheduled tokens computed and appending one sampled token, as Engine._advance/_postprocess do."""

from __future__ import annotations

import torch

from pdserve.runtime.block_manager import BlockLoad, BlockManager
from pdserve.runtime.config import SchedulerConfig
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.pins import PinTable, hold_owner
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.scheduler import Scheduler, SchedulerOutput
from pdserve.runtime.sequence import ExternalKV, Sequence, SequenceStatus

BS = 4
FORMAT = KVFormat.named("0" * 32, "float32", num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)


def _scheduler(num_blocks: int, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    blocks = BlockManager(num_blocks, FORMAT)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), blocks,
                     PinTable(blocks, clock=lambda: 0.0))


def _seq(name: str, n: int, start: int = 0) -> Sequence:
    return Sequence(name, list(range(start, start + n)), SamplingParams())


def _shape(out: SchedulerOutput) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[str]]:
    return ([(s.seq.request_id, s.num_new_tokens) for s in out.decodes],
            [(s.seq.request_id, s.num_new_tokens) for s in out.prefills],
            [s.request_id for s in out.preempted])


def _advance(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after running the step: tokens computed, a sampled token appended."""
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        sched.blocks.commit_full_blocks(s.seq)
        if samples:
            s.seq.output_ids.append(99)


def _block(value: float) -> torch.Tensor:
    return torch.full(FORMAT.shape, value)


def test_prompts_are_admitted_in_order_and_split_by_the_token_budget():
    sched = _scheduler(num_blocks=16, budget=10)
    a, b = _seq("a", 6), _seq("b", 7, start=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert _shape(out) == ([], [("a", 6), ("b", 4)], [])  # b gets what the budget leaves: a chunk
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert out.admitted == [a, b] and out.loads == []
    _advance(sched, out)
    out = sched.schedule()
    assert _shape(out) == ([("a", 1)], [("b", 3)], [])  # a decodes; b finishes its prompt
    sched.blocks.check_leaks([a, b])


def test_out_of_blocks_preempts_the_newest_running_sequence():
    sched = _scheduler(num_blocks=4, budget=64)
    a, b, c = _seq("a", 3), _seq("b", 3, start=100), _seq("c", 7, start=200)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert (a.block_table, b.block_table, c.block_table) == ([0], [1], [2, 3])  # the cache is full
    _advance(sched, out)
    out = sched.schedule()
    assert _shape(out) == ([("a", 1), ("b", 1), ("c", 1)], [], [])  # each token fits its last block
    _advance(sched, out)
    out = sched.schedule()  # a and b need a second block each: none is free
    assert _shape(out) == ([("a", 1), ("b", 1)], [], ["c"])  # the newest gave its blocks back
    assert c.status is SequenceStatus.WAITING and c.block_table == [] and sched.waiting[0] is c
    assert c.num_computed_tokens == 0  # recomputed when readmitted (its full blocks stay cached)
    sched.blocks.check_leaks([a, b])


def test_a_waiting_sequence_holds_no_blocks_and_its_external_kv_loads_at_admission():
    sched = _scheduler(num_blocks=6, max_seqs=1)
    running = _seq("running", 3)
    sched.add(running)
    sched.schedule()  # max_seqs 1: the next waits
    prompt = list(range(50, 60))  # two full blocks and a tail of 2
    hashes = FORMAT.prompt_hashes(prompt)
    s = Sequence("imported", prompt, SamplingParams(), output_ids=[7])  # prefilled elsewhere
    s.external = ExternalKV({h: _block(i) for i, h in enumerate(hashes)}, tail=hashes[-1])
    sched.add(s)
    assert sched.schedule().admitted == [] and s.block_table == []  # waits, holding nothing
    sched.blocks.check_leaks([running])
    sched.finish(running, "stop")
    out = sched.schedule()
    assert out.admitted == [s] and _shape(out) == ([("imported", 1)], [], [])  # only its first token
    assert [(load.block_id, float(load.data[0, 0, 0, 0, 0])) for load in out.loads] == \
        [(s.block_table[0], 0.0), (s.block_table[1], 1.0), (s.block_table[2], 2.0)]
    assert s.num_computed_tokens == 10 and s.num_cached_tokens == 8 and s.external is None
    assert sched.blocks.lookup(hashes[0]) == s.block_table[0]  # full loaded blocks are shareable
    assert sched.blocks.lookup(hashes[2]) is None  # the partial tail is not
    sched.blocks.check_leaks([s])


def test_external_kv_after_a_gap_is_not_used():
    sched = _scheduler(num_blocks=6)
    prompt = list(range(12))
    hashes = FORMAT.full_block_hashes(prompt)
    s = Sequence("gap", prompt, SamplingParams())
    s.external = ExternalKV({hashes[1]: _block(1)})  # block 0 missing: block 1 is useless
    sched.add(s)
    out = sched.schedule()
    assert out.loads == [] and _shape(out) == ([], [("gap", 12)], [])


def test_cached_blocks_are_shared_and_only_the_rest_is_loaded():
    sched = _scheduler(num_blocks=8)
    prompt = list(range(13))  # three full blocks and one token
    first = _seq("first", 5)  # caches block 0 (tokens 0..3)
    sched.add(first)
    _advance(sched, sched.schedule())
    sched.finish(first, "stop")
    hashes = FORMAT.full_block_hashes(prompt)
    s = Sequence("s", prompt, SamplingParams())
    s.external = ExternalKV({h: _block(i) for i, h in enumerate(hashes)})
    sched.add(s)
    out = sched.schedule()
    assert s.block_table[0] == 0  # shared, not loaded
    assert [load.block_id for load in out.loads] == s.block_table[1:3]
    assert _shape(out) == ([("s", 1)], [], []) and s.num_cached_tokens == 12
    assert all(isinstance(load, BlockLoad) for load in out.loads)


def test_holds_give_way_to_a_prompt_that_runs_now_soonest_to_expire_first():
    sched = _scheduler(num_blocks=6)
    pins = sched.pins
    warm = _seq("warm", 13)  # three full blocks cached once it ends
    sched.add(warm)
    _advance(sched, sched.schedule())
    sched.finish(warm, "stop")
    chain = FORMAT.full_block_hashes(warm.prompt_ids)
    assert pins.pin(hold_owner("session"), chain[:2], ttl_s=5) == 2
    assert pins.pin(hold_owner("hot"), chain[2:], ttl_s=9) == 1
    assert sched.blocks.num_free_blocks == 3
    big = _seq("big", 15, start=300)  # four blocks: one more than free
    sched.add(big)
    out = sched.schedule()
    assert out.admitted == [big]
    assert pins.holders(hold_owner("session")) == {chain[1]}  # the soonest-expiring hold went first
    assert pins.holders(hold_owner("hot")) == {chain[2]}
    sched.blocks.check_leaks([big], pins.block_ids())
