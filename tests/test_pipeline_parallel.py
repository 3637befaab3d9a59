"""Pipeline parallelism on CPU: a PP-M engine against the PP-1 one on the same checkpoint, logits
within 1e-4 over prefill + 16 decode steps and the same greedy tokens. One engine runs real stages
(gloo, one process per stage, as a worker does; 3 layers over 2 stages: 2 and 1):
parity, KV blocks moved between a PP-2 engine and a TP-1 one in the canonical layout, and a stage
killed mid-run failing the next step at once instead of hanging; and TP 2 x PP 2 (4 processes).
Micro-batch counts, more stages and TP x PP's KV blocks run the same driver, channel and stage
loop with the ranks as threads (tests/pp_threads.py)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.parallel.group import ParallelConfig
from pdserve.runtime.parallel.launch import tensor_parallel_engine
from pdserve.runtime.parallel.pp_model import split_micro_batches
from pdserve.runtime.parallel.sharding import ShardingError
from pdserve.runtime.parallel.stages import check_stages, stage_costs, stage_ranges
from pdserve.runtime.sampling_params import SamplingParams
from pp_threads import threaded_pp_engine
from test_tensor_parallel import (CONFIG, assert_a_killed_rank_fails_the_next_step, assert_same_run, checkpoint_dir,
                                  decode_with, prefill_blocks, prompts)

TIMEOUT_S = 20.0  # collectives; a dead stage fails them at once, this bounds a hung one
LAYERS = 3  # over 2 stages: layers [0, 2) and [2, 3) (the last stage also runs the head)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def pp1(llama_dir):
    return Engine.from_checkpoint(load_checkpoint(llama_dir), CONFIG)


@pytest.fixture(scope="module")
def pp2(llama_dir):
    """A PP-2 engine of real gloo stages, closed after the module."""
    parallel = ParallelConfig(collective_timeout_s=TIMEOUT_S, pipeline_parallel_size=2, micro_batch_rows=1)
    engine, handle = tensor_parallel_engine(llama_dir, CONFIG, parallel, threads=1)
    yield engine, handle
    handle.close()


def test_pp2_logits_and_greedy_tokens_equal_pp1(pp1, pp2):
    assert pp2[1].model.layout.ranges == ((0, 2), (2, 3))
    assert pp2[0].runner.model.micro_batches == 2  # the decode steps of 3 sequences go as 2 micro-batches
    assert_same_run(pp1, pp2[0])
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert ([r.output_ids for r in pp2[0].generate(prompts(), greedy)]
            == [r.output_ids for r in pp1.generate(prompts(), greedy)])
    pp2[0].check_leaks()


def test_tp2_x_pp2_real_ranks_equal_tp1(llama_dir, pp1):
    """4 processes: 2 stages of 2 tensor-parallel ranks (a gloo group per stage inside the world
    group), the decode steps in 3 micro-batches."""
    parallel = ParallelConfig(2, TIMEOUT_S, pipeline_parallel_size=2, micro_batches=3, micro_batch_rows=1)
    engine, handle = tensor_parallel_engine(llama_dir, CONFIG, parallel, threads=1)
    try:
        assert_same_run(pp1, engine)
        assert [s.steps for s in engine.runner.model.stage_stats()] == [17] * 4
    finally:
        handle.close()
    assert [p.returncode for p in handle.ranks.procs] == [0, 0, 0]  # every rank left on STOP


@pytest.mark.parametrize(("stages", "micro_batches", "tp"), [(2, 1, 1), (2, 4, 1), (3, 2, 1), (4, 3, 1), (2, 2, 2)])
def test_micro_batched_steps_equal_the_unsplit_model(tmp_path_factory, stages, micro_batches, tp):
    """More stages and micro-batch counts, and TP 2 x PP 2, the ranks as threads (Qwen2: biases;
    4 layers, 2 KV heads): the same logits as PP 1 (whose steps are never split), so a
    micro-batched step equals the unsplit one."""
    checkpoint = load_checkpoint(checkpoint_dir(tmp_path_factory, "qwen2", num_hidden_layers=4))
    engine, close = threaded_pp_engine(checkpoint, CONFIG, stages, micro_batches, tp)
    try:
        assert_same_run(Engine.from_checkpoint(checkpoint, CONFIG), engine)
        stats = engine.runner.model.stage_stats()
        assert [s.steps for s in stats] == [17] * stages * tp  # every step went through every rank
        assert all(0 < s.busy_s <= s.step_s for s in stats)
    finally:
        close()


def test_a_decode_step_splits_into_contiguous_micro_batches():
    meta = AttentionMetadata(slot_mapping=torch.tensor([10, 20, 30, 40, 50]), num_decode_tokens=5,
                             decode_block_tables=torch.tensor([[0], [1], [2], [3], [4]]),
                             decode_context_lens=torch.tensor([3, 4, 5, 6, 7]), prefills=())
    ids, pos = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 3, 4, 5, 6])
    parts = split_micro_batches(ids, pos, meta, 2)
    assert [p[0].tolist() for p in parts] == [[1, 2, 3], [4, 5]]
    assert [p[2].decode_context_lens.tolist() for p in parts] == [[3, 4, 5], [6, 7]]
    assert [p[2].decode_block_tables.tolist() for p in parts] == [[[0], [1], [2]], [[3], [4]]]
    assert len(split_micro_batches(ids, pos, meta, 8)) == 5  # never an empty micro-batch
    mixed = AttentionMetadata(slot_mapping=torch.arange(6), num_decode_tokens=5,
                              decode_block_tables=meta.decode_block_tables,
                              decode_context_lens=meta.decode_context_lens,
                              prefills=(PrefillSpan(5, 1, 1, torch.tensor([5])),))
    assert len(split_micro_batches(torch.arange(6), torch.arange(6), mixed, 4)) == 1  # a prefill step goes whole


def test_a_degree_that_does_not_split_the_model_is_refused(llama_dir):
    smollm2 = ModelConfig("llama", 49152, 576, 1536, 30, num_heads=9, num_kv_heads=3, head_dim=64)
    check_stages(smollm2, 4)
    assert [b - a for a, b in stage_ranges(30, 4)] == [7, 8, 7, 8]  # equal costs: as even as 30 / 4 goes
    # The 49152 x 576 head costs what 7.7 layers do: the last stage gets fewer, the slowest stage is fastest.
    assert stage_ranges(30, 2, *stage_costs(smollm2)) == [(0, 19), (19, 30)]
    assert [b - a for a, b in stage_ranges(30, 4, *stage_costs(smollm2))] == [9, 9, 10, 2]
    with pytest.raises(ShardingError, match=r"^--pipeline-parallel-size 31 does not split this model \(30 layers\): "
                                            r"valid sizes are 1 to 30$"):
        check_stages(smollm2, 31)
    with pytest.raises(ShardingError, match="valid sizes are 1 to 3"):  # refused before any stage starts
        tensor_parallel_engine(llama_dir, CONFIG, ParallelConfig(pipeline_parallel_size=4))


@pytest.mark.parametrize("direction", ["pp2_to_tp1", "tp1_to_pp2"])
def test_kv_blocks_move_between_pp2_and_tp1_in_the_canonical_layout(llama_dir, pp1, pp2, direction):
    """A prefill at one layout, the decode at the other, from its exported blocks: the output of an
    in-process engine, and the blocks it would have exported (all layers, all KV heads)."""
    rng = random.Random(direction)
    prompt = [rng.randrange(3, 160) for _ in range(40)]  # 2 full blocks and a tail, new to both engines
    reference = Engine.from_checkpoint(load_checkpoint(llama_dir), CONFIG)
    expected = reference.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    ref_first, ref_hashes, ref_blocks = prefill_blocks(reference, "ref", prompt)
    src, dst = (pp2[0], pp1) if direction == "pp2_to_tp1" else (pp1, pp2[0])
    first, hashes, blocks = prefill_blocks(src, f"p-{direction}", prompt)
    assert (first, hashes) == (ref_first, ref_hashes)
    for h in hashes:
        assert blocks[h].shape == (LAYERS, 2, 16, 2, 8)
        assert (blocks[h] - ref_blocks[h]).abs().max().item() <= 1e-5
    assert decode_with(dst, f"d-{direction}", prompt, first, hashes, blocks) == expected.output_ids
    src.check_leaks()
    dst.check_leaks()


def test_kv_blocks_move_from_tp2_x_pp2_to_tp1_and_back(llama_dir, pp1):
    """TP 2 x PP 2 (ranks as threads): each rank holds one KV head of its stage's layers; blocks
    leave whole, and come back in."""
    checkpoint = load_checkpoint(llama_dir)
    engine, close = threaded_pp_engine(checkpoint, CONFIG, 2, tp=2)
    try:
        prompt = [random.Random(5).randrange(3, 160) for _ in range(40)]
        expected = pp1.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
        ref_first, ref_hashes, ref_blocks = prefill_blocks(Engine.from_checkpoint(checkpoint, CONFIG), "ref", prompt)
        first, hashes, blocks = prefill_blocks(engine, "p-2x2", prompt)
        assert (first, hashes) == (ref_first, ref_hashes)
        for h in hashes:
            assert blocks[h].shape == (LAYERS, 2, 16, 2, 8)
            assert (blocks[h] - ref_blocks[h]).abs().max().item() <= 1e-5
        assert decode_with(pp1, "d-2x2", prompt, first, hashes, blocks) == expected.output_ids
        back = [random.Random(6).randrange(3, 160) for _ in range(40)]
        expected = pp1.generate([back], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
        first, hashes, blocks = prefill_blocks(pp1, "p-tp1", back)
        assert decode_with(engine, "d-tp1", back, first, hashes, blocks) == expected.output_ids
        engine.check_leaks()
    finally:
        close()


def test_a_killed_stage_fails_the_next_step_at_once_and_no_stage_is_left(pp2):
    """Last: it kills the module's PP-2 engine (its last stage, rank 1)."""
    engine, handle = pp2
    assert_a_killed_rank_fails_the_next_step(engine, handle)
    engine.abort("a")
