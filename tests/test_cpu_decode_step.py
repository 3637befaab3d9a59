"""The one-call C decode step (pdserve.runtime.kernels.cpu_decode_step) against the eager step: the
same engine, the same requests, every decode step's hidden states, logits and KV cache equal bit for
bit, on one thread and split over two; where it steps aside (a prompt row, another format) and what
it refuses."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_attention, cpu_int4_matmul
from pdserve.runtime.kernels.cpu_decode_step import LOADED_OF_WINDOW, LOADED_STEPS, DecodeStepPlan, StepThreads
from pdserve.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the kernels cannot be built")


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _int4_engine(checkpoint, dtype: str = "float32", weight_format: str = "int4", kv_dtype: str = "",
                 dense_copy: bool = False) -> Engine:
    cache = CacheConfig(num_blocks=96, dtype=kv_dtype or dtype)
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=cache, dtype=dtype, weight_format=weight_format,
                                                             dense_copy=dense_copy))
    engine.keep_logits = True
    return engine


@pytest.fixture(scope="module")
def int4_engine(smollm2) -> Engine:
    return _int4_engine(smollm2)


def _decode_trace(engine: Engine, prompts: list[list[int]], steps: int, monkeypatch, one_call: bool,
                  arrive_every: int = 0) -> dict:
    """Every forward's output and logits of greedy requests from `prompts`, the tokens, the final KV
    cache, and how many steps the C step ran (none unless `one_call`). Requests arrive together, or
    one every `arrive_every` steps (later prompts then share a step with earlier requests' decodes)."""
    model = engine.runner.model
    runs, hidden, mixed = [0], [], [0]
    plan_run = DecodeStepPlan.run

    def counted(self, *args):
        runs[0] += 1
        return plan_run(self, *args)

    def recorded(*args, **kwargs):
        meta = args[2]
        mixed[0] += bool(meta.num_decode_tokens and meta.prefills)
        out = type(model).forward(model, *args, **kwargs)
        hidden.append(out.clone())
        return out

    monkeypatch.setattr(DecodeStepPlan, "run", counted)
    monkeypatch.setattr(model, "forward", recorded)
    if not one_call:
        monkeypatch.setattr(model, "one_call_decode_step", lambda: None)
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    waiting = list(enumerate(prompts))
    tokens: dict[str, list[int]] = {}
    logits = []
    step = 0
    while waiting or engine.has_unfinished():
        while waiting and step >= waiting[0][0] * arrive_every:
            i, ids = waiting.pop(0)
            engine.add_request(f"r{i}", ids, params)
        step += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        logits.append(engine.last_logits.clone())
    monkeypatch.undo()
    return {"hidden": hidden, "logits": logits, "tokens": tokens, "kv": engine.runner.kv_cache.clone(),
            "c_steps": runs[0], "mixed_steps": mixed[0]}


def _assert_same_bits(one_call: dict, eager: dict) -> None:
    """Two `_decode_trace`s gave the same tokens, and every step's hidden states, logits and the KV
    cache bit for bit."""
    assert one_call["tokens"] == eager["tokens"]
    assert len(one_call["hidden"]) == len(eager["hidden"])
    for a, b in zip(one_call["hidden"], eager["hidden"]):
        assert torch.equal(a, b)
    for a, b in zip(one_call["logits"], eager["logits"]):
        assert torch.equal(a, b)
    assert torch.equal(one_call["kv"], eager["kv"])


# Several int4-exact sequences on two threads: the mixed-step test below (4 sequences, 2 threads).
# 9 sequences on two threads: steps of FINE_FROM_ROWS (8) or more take each phase in chunks, each
# taken by whichever thread asks first (decode_step.c's take_items).
@pytest.mark.parametrize("batch,threads,weight_format", [(1, 1, "int4"), (5, 1, "int4"), (5, 2, "int4"),
                                                         (9, 2, "int4"), (1, 2, "int4-exact")])
def test_the_one_call_step_equals_the_eager_step_bit_for_bit(smollm2, batch, threads, weight_format, monkeypatch):
    """On the same thread count (the prompts' dense GEMM rounds by it), decode steps in C and the eager
    layers, each on an engine of its own (the same blocks, no prefix cached from the other). Prompts of
    several lengths put contexts across block boundaries (16-token blocks); two threads split every
    phase of the C step (5 sequences: 3 and 2, their attention's 15 (sequence, kv head) pairs 7 and 8;
    one sequence: its 3 kv heads 1 and 2). int4-exact: the step's projections on the W4A32 kernel."""
    prompts = [smollm2.tokenizer.encode("Tell me about the sea." + " And the ships." * (3 * i)) for i in range(batch)]
    with torch_threads(threads):
        one_call = _decode_trace(_int4_engine(smollm2, weight_format=weight_format), prompts, 12, monkeypatch,
                                 one_call=True)
        eager = _decode_trace(_int4_engine(smollm2, weight_format=weight_format), prompts, 12, monkeypatch,
                              one_call=False)
    assert one_call["c_steps"] == 11 and eager["c_steps"] == 0  # every step after the prompts' one
    _assert_same_bits(one_call, eager)


def test_a_step_that_admits_a_prompt_runs_its_decodes_in_c_with_the_eager_bits(smollm2, monkeypatch):
    """A prompt arrives every 3 steps: those steps hold decodes and a prompt chunk; the decode rows go
    to the C step, the prompt's through the layers (model._split_forward), with the bits of the whole
    step run eagerly (W4A32: each kind of row on a function of its own, the kernel or the dense GEMM)."""
    prompts = [smollm2.tokenizer.encode("Tell me about the sea." + " And the ships." * i) for i in range(4)]
    with torch_threads(2):
        one_call = _decode_trace(_int4_engine(smollm2, weight_format="int4-exact"), prompts, 8, monkeypatch,
                                 one_call=True, arrive_every=3)
        eager = _decode_trace(_int4_engine(smollm2, weight_format="int4-exact"), prompts, 8, monkeypatch,
                              one_call=False, arrive_every=3)
    assert one_call["mixed_steps"] == 3 and eager["c_steps"] == 0
    assert one_call["c_steps"] == len(one_call["hidden"]) - 1  # every step but the first prompt's alone
    _assert_same_bits(one_call, eager)


def test_a_step_splits_into_its_generated_decodes_and_the_rest():
    """Rows: a generated decode, a resumed request's last prompt token (a decode row of a prompt
    token), another generated decode, then a 3-token prompt chunk."""
    from pdserve.runtime.attention import AttentionMetadata, PrefillSpan, split_generated_decodes

    chunk = PrefillSpan(query_start=3, query_len=3, context_len=7, block_table=torch.tensor([4]))
    meta = AttentionMetadata(torch.arange(10, 16), 3, torch.tensor([[0, 5], [1, 0], [2, 6]]), torch.tensor([20, 9, 30]),
                             (chunk,), torch.tensor([True, False, True, False, False, False]))
    split = split_generated_decodes(meta)
    assert split.decode_rows.tolist() == [0, 2] and split.rest_rows.tolist() == [1, 3, 4, 5]
    assert split.decode.slot_mapping.tolist() == [10, 12] and split.decode.num_decode_tokens == 2
    assert split.decode.decode_block_tables.tolist() == [[0, 5], [2, 6]]
    assert split.decode.decode_context_lens.tolist() == [20, 30] and not split.decode.prefills
    assert split.decode.generated_rows.tolist() == [True, True]
    assert split.rest.slot_mapping.tolist() == [11, 13, 14, 15] and split.rest.num_decode_tokens == 1
    assert split.rest.decode_block_tables.tolist() == [[1, 0]] and split.rest.decode_context_lens.tolist() == [9]
    (span,) = split.rest.prefills
    assert (span.query_start, span.query_len, span.context_len) == (1, 3, 7)
    assert split.rest.generated_rows.tolist() == [False, False, False, False]
    whole = AttentionMetadata(torch.arange(2), 2, torch.tensor([[0], [1]]), torch.tensor([3, 4]), (),
                              torch.tensor([True, True]))
    assert split_generated_decodes(whole) is None  # nothing to split: the C step takes it whole
    assert split_generated_decodes(AttentionMetadata(torch.arange(3), 0, torch.zeros(0, 1, dtype=torch.long),
                                                     torch.zeros(0, dtype=torch.long), (chunk,),
                                                     torch.tensor([False] * 3))) is None
    assert split_generated_decodes(replace(meta, generated_rows=None)) is None  # kinds not told


@pytest.mark.parametrize("batch,threads", [(4, 1), (3, 2)])  # on 2 threads one thread has a single row
def test_the_bf16_one_call_step_equals_the_eager_step_bit_for_bit(smollm2_bf16, batch, threads, monkeypatch):
    """bf16 (a bf16 cache): steps of fewer than BF16_Q8_BELOW_ROWS sequences run in C, on the same
    functions as the eager step's (the 4-bit projections on our kernel, SiLU in C)."""
    prompts = [smollm2_bf16.tokenizer.encode("Tell me about the sea." + " And the ships." * (3 * i))
               for i in range(batch)]
    with torch_threads(threads):
        one_call = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16"), prompts, 12, monkeypatch, one_call=True)
        eager = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16"), prompts, 12, monkeypatch, one_call=False)
    assert one_call["c_steps"] == 11 and eager["c_steps"] == 0
    assert all(a.dtype == torch.bfloat16 for a in one_call["hidden"])
    _assert_same_bits(one_call, eager)


@pytest.mark.parametrize("dtype,batch,threads", [("bfloat16", 3, 1), ("bfloat16", 3, 2), ("float32", 2, 1),
                                                 ("float32", 9, 2)])
def test_an_int8_cache_takes_the_one_call_step_with_the_eager_bits(request, dtype, batch, threads, monkeypatch):
    """An INT8 KV cache (--kv-dtype int8): the C step writes and reads it with the eager step's
    functions (kv_write.c's scale upkeep and requantize, the bf16 / fp32-over-INT8 attention), so the
    tokens, every step's hidden states and logits and the cache's codes and scales are the eager
    ones to the bit. 14 decode steps from prompts of different lengths start and grow blocks; 9
    sequences on two threads split each phase in chunks."""
    checkpoint = request.getfixturevalue("smollm2_bf16" if dtype == "bfloat16" else "smollm2")
    prompts = [checkpoint.tokenizer.encode("Tell me about the sea." + " And the ships." * (2 * i))
               for i in range(batch)]
    with torch_threads(threads):
        one_call = _decode_trace(_int4_engine(checkpoint, dtype, kv_dtype="int8"), prompts, 15, monkeypatch,
                                 one_call=True)
        eager = _decode_trace(_int4_engine(checkpoint, dtype, kv_dtype="int8"), prompts, 15, monkeypatch,
                              one_call=False)
    assert one_call["kv"].dtype == torch.int8
    assert one_call["c_steps"] == 14 and eager["c_steps"] == 0
    _assert_same_bits(one_call, eager)


def test_a_bf16_step_of_five_sequences_runs_eagerly_unless_the_cpu_has_amx(smollm2_bf16, monkeypatch):
    prompts = [smollm2_bf16.tokenizer.encode(f"Count to {i}.") for i in range(5)]
    trace = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16"), prompts, 3, monkeypatch, one_call=True)
    assert trace["c_steps"] == (2 if cpu_int4_matmul.amx_available() else 0)  # the steps after the prompts


@pytest.mark.parametrize("batch,threads,arrive_every", [(3, 1, 0), (6, 1, 0), (17, 2, 0), (7, 1, 3)])
def test_a_bf16_step_of_more_sequences_runs_in_c_on_the_vnni_gemm_with_the_eager_bits(
        smollm2_bf16, batch, threads, arrive_every, monkeypatch):
    """A worker's engine (the dense copy) on a CPU with AVX512-VNNI and no AMX keeps the VNNI GEMM's copy
    of each projection: decode steps of any size run in C, their projections on the GEMM as the eager
    step's however few the sequences (split over two threads by pairs of 16-output panels, one part a
    thread: each part quantizes the inputs, as each thread of the eager call does). Prompts arriving every
    3 steps share steps with decodes: the decode rows run in C, the prompt's eagerly on the dense copy.
    Elsewhere (AMX, or no VNNI) there is no GEMM's copy and the plan says so."""
    prompts = [smollm2_bf16.tokenizer.encode(f"Tell me about the sea, number {i}." + " And the ships." * (i % 4))
               for i in range(batch)]
    with torch_threads(threads):
        engine = _int4_engine(smollm2_bf16, "bfloat16", dense_copy=True)
        one_call = _decode_trace(engine, prompts, 8, monkeypatch, one_call=True, arrive_every=arrive_every)
        eager = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16", dense_copy=True), prompts, 8, monkeypatch,
                              one_call=False, arrive_every=arrive_every)
    _assert_same_bits(one_call, eager)
    gemm = cpu_int4_matmul.q8_gemm_available() and not cpu_int4_matmul.amx_available()
    assert engine.runner.model.one_call_decode_step().q8_gemm == gemm
    if gemm:  # every step but the first prompt's alone
        assert one_call["c_steps"] == len(one_call["hidden"]) - 1 and eager["c_steps"] == 0
        assert one_call["mixed_steps"] == (batch - 1 if arrive_every else 0)


@pytest.mark.parametrize("batch", [3, 9])
def test_two_threads_beside_a_busy_process_give_the_eager_bits(smollm2, batch, monkeypatch):
    """Another process spinning on a core: the C step's threads wait at its barriers asleep (and the
    plan runs later steps on one thread after a step that found its cores taken); the bits stay the
    eager step's, whichever thread count each step ran on, and (9 sequences: chunks taken by whichever
    thread asks first) however the preempted thread's chunks fell to the other."""
    prompts = [smollm2.tokenizer.encode("Tell me about the sea." + " And the ships." * (2 * i)) for i in range(batch)]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with torch_threads(2):
            one_call = _decode_trace(_int4_engine(smollm2), prompts, 8, monkeypatch, one_call=True)
            eager = _decode_trace(_int4_engine(smollm2), prompts, 8, monkeypatch, one_call=False)
    finally:
        hog.kill()
        hog.wait()
    assert one_call["c_steps"] == 7
    assert one_call["tokens"] == eager["tokens"]
    for a, b in zip(one_call["logits"], eager["logits"]):
        assert torch.equal(a, b)
    assert torch.equal(one_call["kv"], eager["kv"])


def test_the_engines_step_threads_reach_the_plan(smollm2_bf16):
    engine = Engine.from_checkpoint(smollm2_bf16, EngineConfig(cache=CacheConfig(num_blocks=16, dtype="bfloat16"),
                                                               dtype="bfloat16", weight_format="int4", step_threads=3))
    threads = engine.runner.model.one_call_decode_step().threads
    assert threads.next() == 3


def test_once_most_recent_steps_found_their_cores_taken_the_next_run_on_one_thread():
    threads = StepThreads()
    with torch_threads(2):
        assert threads.next() == 2
        for loaded in [True, True, False, False] * 6 + [False] * 8:  # now and then (a cold step, a preemption)
            threads.after(loaded=loaded)
            assert threads.next() == 2
        for _ in range(LOADED_OF_WINDOW - 1):  # a busy neighbour: every step loaded, but one
            threads.after(loaded=True)
        threads.after(loaded=False)
        assert threads.next() == 2
        threads.after(loaded=True)
        assert [threads.next() for _ in range(LOADED_STEPS)] == [1] * LOADED_STEPS
        assert threads.next() == 2
    budget = [3]
    shared = StepThreads(lambda: budget[0])  # the host's core share: its count of the moment
    assert shared.next() == 3
    budget[0] = 1
    assert shared.next() == 1


def test_a_decode_row_of_a_prompt_token_runs_eagerly(int4_engine, smollm2):
    """A resumed request's last prompt token, run as a decode, is a prompt row: dense, so not here."""
    from pdserve.runtime.attention import AttentionMetadata

    plan = int4_engine.runner.model.one_call_decode_step()
    hidden, cache = torch.zeros(2, 576), int4_engine.runner.kv_cache

    def meta(generated: list[bool]) -> AttentionMetadata:
        return AttentionMetadata(torch.tensor([0, 16]), 2, torch.tensor([[0], [1]]), torch.tensor([1, 1]), (),
                                 torch.tensor(generated))

    assert plan.applies(hidden, meta([True, True]), cache)
    assert not plan.applies(hidden, meta([True, False]), cache)
    assert not plan.applies(hidden, AttentionMetadata(torch.tensor([0, 16]), 2, torch.tensor([[0], [1]]),
                                                      torch.tensor([1, 1]), ()), cache)  # kinds not told
    assert not plan.applies(hidden.bfloat16(), meta([True, True]), cache)


def test_a_position_past_the_rope_tables_is_an_index_error(int4_engine):
    from pdserve.runtime.attention import AttentionMetadata

    plan = int4_engine.runner.model.one_call_decode_step()
    past = int4_engine.runner.model.config.max_position_embeddings
    meta = AttentionMetadata(torch.tensor([0]), 1, torch.tensor([[0]]), torch.tensor([1]), (), torch.tensor([True]))
    with pytest.raises(IndexError, match="RoPE tables"):
        plan.run(torch.zeros(1, 576), torch.tensor([past]), meta, int4_engine.runner.kv_cache)


def test_models_it_does_not_cover_have_no_plan(smollm2):
    """Dense fp32 keeps MKL's matmuls (eager); bf16 int4 runs torch's kernel."""
    dense = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=8), dtype="float32",
                                                         weight_format="dense"))
    assert dense.runner.model.one_call_decode_step() is None


def test_a_slot_past_the_cache_is_an_index_error_before_anything_is_written(int4_engine):
    from pdserve.runtime.attention import AttentionMetadata

    plan = int4_engine.runner.model.one_call_decode_step()
    cache = int4_engine.runner.kv_cache
    before = cache.clone()
    past = cache.shape[0] * cache.shape[3]
    meta = AttentionMetadata(torch.tensor([past]), 1, torch.tensor([[0]]), torch.tensor([1]), (), torch.tensor([True]))
    with pytest.raises(IndexError, match="outside the cache"):
        plan.run(torch.zeros(1, 576), torch.tensor([0]), meta, cache)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("slot", [-1, 96 * 16])
def test_an_int8_caches_slot_outside_it_is_an_index_error_before_anything_is_written(smollm2, slot):
    """The INT8 write takes no padding slot (< 0), as none past the cache: the step refuses both."""
    from pdserve.runtime.attention import AttentionMetadata

    engine = _int4_engine(smollm2, kv_dtype="int8")
    plan, cache = engine.runner.model.one_call_decode_step(), engine.runner.kv_cache
    before = cache.clone()
    meta = AttentionMetadata(torch.tensor([slot]), 1, torch.tensor([[0]]), torch.tensor([1]), (), torch.tensor([True]))
    with pytest.raises(IndexError, match="outside the cache"):
        plan.run(torch.zeros(1, 576), torch.tensor([0]), meta, cache)
    assert torch.equal(cache, before)


@pytest.mark.skipif(not cpu_int4_matmul.amx_available(), reason="needs a CPU with AMX-BF16")
@pytest.mark.parametrize("batch,threads", [(6, 1), (17, 2)])
def test_a_bf16_step_of_more_sequences_runs_in_c_on_amx_with_the_eager_bits(smollm2_bf16, batch, threads,
                                                                            monkeypatch):
    """On a CPU with AMX-BF16 steps of 5 to AMX_BELOW_ROWS - 1 sequences run in C too, their projections
    on the AMX kernel as the eager step's (split over two threads by 32-row panels; 17 sequences fill
    the kernel's two row groups of tiles, the second partly)."""
    prompts = [smollm2_bf16.tokenizer.encode(f"Tell me about the sea, number {i}." + " And the ships." * (i % 4))
               for i in range(batch)]
    with torch_threads(threads):
        one_call = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16"), prompts, 6, monkeypatch, one_call=True)
        eager = _decode_trace(_int4_engine(smollm2_bf16, "bfloat16"), prompts, 6, monkeypatch, one_call=False)
    assert one_call["c_steps"] == 5 and eager["c_steps"] == 0
    _assert_same_bits(one_call, eager)
