"""Tensor parallelism on CPU: a TP-N engine against the TP-1 one on the same checkpoint, logits
within 1e-4 over prefill + 16 decode steps and the same greedy tokens. One engine runs real ranks
(gloo, one process per rank, as a worker does): parity, KV blocks moved between engines of
different degrees in the canonical layout, and a rank killed mid-run failing the next step at
once instead of hanging. More configs (TP 4, replicated KV heads, Qwen2 biases, a tied and padded
vocabulary, GPTQ INT4) run the same driver, channel and follower loop with the ranks as threads
(tests/tp_threads.py), so that each costs no process start."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from conftest import STORIES_GGUF, random_hf_model
from pdserve.cli import build_parser
from pdserve.quant.checkpoint import write_gguf_tokenizer
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.runtime.engine import AddRequest, Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.parallel.group import ParallelConfig
from pdserve.runtime.parallel.kv_shard import merge_heads
from pdserve.runtime.parallel.launch import tensor_parallel_engine
from pdserve.runtime.parallel.protocol import pack_step, unpack_step
from pdserve.runtime.parallel.sharding import (ShardingError, check_degree, kv_head_owners, shard_layout,
                                               valid_degrees)
from pdserve.runtime.sampling_params import SamplingParams
from test_engine_parity import run_collecting_logits
from tp_threads import threaded_tp_engine
from waiting import wait_until

TOL = 1e-4
STEPS = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)  # prefill + 16 decode steps
CONFIG = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64))
TIMEOUT_S = 20.0  # collectives; a dead rank fails them at once, this bounds a hung one


def checkpoint_dir(tmp_path_factory, architecture: str, **overrides):
    d = tmp_path_factory.mktemp(architecture)
    random_hf_model(architecture, seed=4, **overrides).save_pretrained(d)
    write_gguf_tokenizer(STORIES_GGUF, d / "tokenizer.gguf")  # any tokenizer the loader reads
    return d


def prompts(n: int = 3) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 160) for _ in range(k)] for k in (7, 23, 40)[:n]]


def assert_same_run(reference: Engine, engine: Engine, vocab: int = 160) -> None:
    ref = run_collecting_logits(reference, prompts(), STEPS)
    got = run_collecting_logits(engine, prompts(), STEPS)
    for rid, rows in ref.items():
        a, b = torch.stack(rows), torch.stack(got[rid])  # [17, V]
        assert a.shape == b.shape == (17, vocab)
        diff = (a - b).abs().max().item()
        assert diff <= TOL, f"{rid}: max |logit diff| {diff:.2e} > {TOL}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def tp2(llama_dir):
    """A TP-2 engine (8 heads, 2 KV heads: one KV head per rank), closed after the module."""
    engine, handle = tensor_parallel_engine(llama_dir, CONFIG, ParallelConfig(2, TIMEOUT_S), threads=1)
    yield engine, handle
    handle.close()


@pytest.fixture(scope="module")
def tp1(llama_dir):
    return Engine.from_checkpoint(load_checkpoint(llama_dir), CONFIG)


def test_tp2_logits_and_greedy_tokens_equal_tp1(tp1, tp2):
    assert_same_run(tp1, tp2[0])
    tp2[0].check_leaks()


def test_tp2_gptq_int4_equals_tp1(tmp_path_factory, llama_dir):
    """GPTQ INT4 (g32) weights split on packed words and their groups (ranks as threads)."""
    out = tmp_path_factory.mktemp("int4")
    args = build_parser().parse_args(["quantize", "--model", str(llama_dir), "--out", str(out), "--method", "rtn",
                                      "--bits", "4", "--group-size", "32"])
    assert args._run(args) == 0
    checkpoint = load_checkpoint(out)
    assert isinstance(checkpoint.weights["model.layers.0.mlp.down_proj.weight"], QuantizedWeight)
    engine, close = threaded_tp_engine(checkpoint, CONFIG, 2)
    try:
        assert_same_run(Engine.from_checkpoint(checkpoint, CONFIG), engine)
    finally:
        close()


@pytest.mark.parametrize(("architecture", "size", "overrides"), [
    ("llama", 4, {}),  # 8 heads over 4 ranks, 2 KV heads each on 2 ranks
    ("qwen2", 2, {"num_key_value_heads": 1}),  # one KV head on both ranks
    ("qwen2", 4, {}),  # biases split with their heads
    ("mistral", 2, {"num_key_value_heads": 4}),  # 2 KV heads per rank
    ("llama", 2, {"tie_word_embeddings": True, "vocab_size": 157}),  # a tied head, a vocabulary padded per rank
])
def test_more_configs_with_the_ranks_as_threads(tmp_path_factory, architecture, size, overrides):
    """The same driver, channel, follower loop and shards, over an in-process group (tests/tp_threads.py)."""
    d = checkpoint_dir(tmp_path_factory, architecture, **overrides)
    checkpoint = load_checkpoint(d)
    engine, close = threaded_tp_engine(checkpoint, CONFIG, size)
    try:
        assert_same_run(Engine.from_checkpoint(checkpoint, CONFIG), engine, vocab=overrides.get("vocab_size", 160))
    finally:
        close()


def test_a_degree_that_does_not_split_the_model_names_the_valid_ones(llama_dir):
    smollm2 = ModelConfig("llama", 49152, 576, 1536, 30, num_heads=9, num_kv_heads=3, head_dim=64)
    assert valid_degrees(smollm2) == [1, 3]
    with pytest.raises(ShardingError, match=r"^--tensor-parallel-size 2 does not split this model \(9 attention "
                                            r"heads, 3 KV heads, MLP 1536\): valid sizes are 1, 3$"):
        check_degree(smollm2, 2)
    with pytest.raises(ShardingError, match="valid sizes are 1, 2, 4, 8"):  # refused before any rank starts
        tensor_parallel_engine(llama_dir, CONFIG, ParallelConfig(3, TIMEOUT_S))
    assert [shard_layout(smollm2, r, 3).kv_heads for r in range(3)] == [(0, 1), (1, 2), (2, 3)]


def test_step_inputs_survive_the_broadcast_format():
    meta = AttentionMetadata(slot_mapping=torch.tensor([33, 70, 71, 72]), num_decode_tokens=1,
                             decode_block_tables=torch.tensor([[2, 0]]), decode_context_lens=torch.tensor([18]),
                             prefills=(PrefillSpan(1, 3, 3, torch.tensor([4])),))
    ids, pos, got = unpack_step(pack_step(torch.tensor([9, 5, 6, 7]), torch.tensor([17, 0, 1, 2]), meta))
    assert ids.tolist() == [9, 5, 6, 7] and pos.tolist() == [17, 0, 1, 2]
    assert got.slot_mapping.tolist() == [33, 70, 71, 72] and got.num_decode_tokens == 1
    assert got.decode_block_tables.tolist() == [[2, 0]] and got.decode_context_lens.tolist() == [18]
    (span,) = got.prefills
    assert (span.query_start, span.query_len, span.context_len, span.block_table.tolist()) == (1, 3, 3, [4])
    assert got.generated_rows is None  # not told: every rank's projections choose by row count alike


def test_the_token_kinds_reach_every_rank():
    """A step's generated rows travel with it, so that a tensor-parallel follower's int4 projections split
    the rows by token kind as rank 0's do (before, followers were not told and chose by row count)."""
    meta = AttentionMetadata(slot_mapping=torch.tensor([33, 70, 71, 72]), num_decode_tokens=1,
                             decode_block_tables=torch.tensor([[2, 0]]), decode_context_lens=torch.tensor([18]),
                             prefills=(PrefillSpan(1, 3, 3, torch.tensor([4])),),
                             generated_rows=torch.tensor([True, False, False, True]))
    ids, pos, got = unpack_step(pack_step(torch.tensor([9, 5, 6, 7]), torch.tensor([17, 0, 1, 2]), meta))
    assert got.generated_rows.dtype == torch.bool and got.generated_rows.tolist() == [True, False, False, True]
    assert ids.tolist() == [9, 5, 6, 7] and got.slot_mapping.tolist() == [33, 70, 71, 72]
    (span,) = got.prefills
    assert (span.query_start, span.query_len, span.context_len, span.block_table.tolist()) == (1, 3, 3, [4])


def test_canonical_blocks_take_each_kv_head_once():
    """TP 4 over 2 KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1; TP 2 over 4: two each."""
    config = ModelConfig("llama", 160, 64, 128, 2, num_heads=8, num_kv_heads=2, head_dim=8)
    assert kv_head_owners(config, 4) == [0, 2]
    block = torch.randn(2, 2, 16, 2, 8)  # [layers, 2, rows, KVH, D]
    shards = [block[..., shard_layout(config, r, 4).kv_heads[0]:shard_layout(config, r, 4).kv_heads[1], :]
              for r in range(4)]
    assert torch.equal(merge_heads(shards, kv_head_owners(config, 4)), block)
    wide = ModelConfig("llama", 160, 64, 128, 2, num_heads=8, num_kv_heads=4, head_dim=8)
    block = torch.randn(2, 2, 16, 4, 8)
    assert torch.equal(merge_heads([block[..., :2, :], block[..., 2:, :]], kv_head_owners(wide, 2)), block)


def prefill_blocks(engine: Engine, rid: str, prompt: list[int]):
    """(first token, prompt hashes, canonical blocks) of a held prefill, as a prefill worker exports them."""
    engine.add(AddRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0), hold_blocks=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    blocks = engine.export_held(rid)
    engine.release_held(rid)
    return outs[-1].new_token_ids[0], [b.hash for b in blocks], {b.hash: b.data for b in blocks}


def decode_with(engine: Engine, rid: str, prompt: list[int], first: int, hashes, blocks) -> list[int]:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seq = engine.add(AddRequest(rid, prompt, params, first_token=first, prompt_hashes=hashes, blocks=blocks))
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens > 0  # the blocks were used, not recomputed
    return seq.output_ids


@pytest.mark.parametrize("direction", ["tp2_to_tp1", "tp1_to_tp2"])
def test_kv_blocks_move_between_degrees_in_the_canonical_layout(llama_dir, tp1, tp2, direction):
    """A prefill at one degree, the decode at the other, from its exported blocks: the output of
    an in-process TP-1 engine, and the blocks it would have exported."""
    rng = random.Random(direction)
    prompt = [rng.randrange(3, 160) for _ in range(40)]  # 2 full blocks and a tail, new to both engines
    reference = Engine.from_checkpoint(load_checkpoint(llama_dir), CONFIG)
    expected = reference.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    ref_first, ref_hashes, ref_blocks = prefill_blocks(reference, "ref", prompt)
    src, dst = (tp2[0], tp1) if direction == "tp2_to_tp1" else (tp1, tp2[0])
    first, hashes, blocks = prefill_blocks(src, f"p-{direction}", prompt)
    assert (first, hashes) == (ref_first, ref_hashes)
    for h in hashes:  # all KV heads, in order, whatever degree wrote them
        assert blocks[h].shape == (2, 2, 16, 2, 8)
        assert (blocks[h] - ref_blocks[h]).abs().max().item() <= 1e-5
    assert decode_with(dst, f"d-{direction}", prompt, first, hashes, blocks) == expected.output_ids
    src.check_leaks()
    dst.check_leaks()


def assert_a_killed_rank_fails_the_next_step(engine: Engine, handle) -> None:
    """SIGKILL rank 1 of `engine` mid-request: its exit is seen, and the next step fails at once
    (the closed socket), well before the collective timeout."""
    exits: list[tuple[int, int]] = []
    handle.ranks.watch(lambda rank, code: exits.append((rank, code)))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    os.kill(handle.ranks.pids[0], signal.SIGKILL)
    assert wait_until(lambda: exits, timeout_s=10) == [(1, -signal.SIGKILL)]
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < TIMEOUT_S / 2  # the closed socket, not the timeout


def test_a_killed_rank_fails_the_next_step_at_once_and_no_rank_is_left(tp2):
    """Last: it kills the module's TP-2 engine."""
    engine, handle = tp2
    assert_a_killed_rank_fails_the_next_step(engine, handle)
    engine.abort("a")
