"""The C write into the INT8 paged KV cache (pdserve.runtime.kernels.cpu_kv_write) against the torch
reference kv_quant.write_kv on the same starting cache: byte-for-byte equal caches (codes and scale
rows), then an engine that serves with it against one on the torch path, and its fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.runtime.kernels import cpu_attention, cpu_kv_write, kv_quant, torch_ops

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the kernel cannot be built")

SMOLLM2, STORIES = (3, 64), (4, 8)  # (KV heads, head dim) of SmolLM2-135M and stories260K
SHAPES = [SMOLLM2, STORIES]
DTYPES = [torch.float32, torch.bfloat16]
BS, LAYERS = 16, 3


def _random_cache(kv_heads: int, dim: int, num_blocks: int = 24, seed: int = 0) -> torch.Tensor:
    """[NB, LAYERS, 2, BS + 1, KVH, D] int8: random codes and a random positive scale per head (a cache
    in use: the requantize path then has real codes to rescale)."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randint(-127, 128, (num_blocks, LAYERS, 2, BS + 1, kv_heads, dim), generator=gen, dtype=torch.int8)
    kv_quant.scales_view(cache)[:] = torch.rand(num_blocks, LAYERS, 2, kv_heads, generator=gen) * 0.05 + 1e-3
    return cache


def _rows(n: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int, magnitude: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, kv_heads, dim, generator=gen) * magnitude
    v = torch.randn(n, kv_heads, dim, generator=gen) * magnitude
    return k.to(dtype), v.to(dtype)


def _assert_same_write(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
    """Writes with both paths from copies of `cache`; asserts the same bytes; returns the C path's cache."""
    want, got = cache.clone(), cache.clone()
    kv_quant.write_kv(want, layer, k, v, slots)
    assert cpu_kv_write.write_kv(got, layer, k, v, slots)
    differ = (want != got).nonzero()
    assert differ.shape[0] == 0, f"{differ.shape[0]} bytes differ, first at {differ[0].tolist()}"
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim", SHAPES)
def test_prefill_chunks_over_several_blocks(dtype, kv_heads, dim):
    """A 200-token prompt in chunks of 70 (the second and third start mid-block) over shuffled blocks."""
    cache = _random_cache(kv_heads, dim)
    table = torch.randperm(23, generator=torch.Generator().manual_seed(1))[:13] + 1
    positions = torch.arange(200)
    slots = table[positions // BS] * BS + positions % BS
    k, v = _rows(200, kv_heads, dim, dtype, seed=2, magnitude=3.0)
    for start in range(0, 200, 70):
        cache = _assert_same_write(cache, 1, k[start:start + 70], v[start:start + 70], slots[start:start + 70])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim", SHAPES)
def test_a_chunk_starting_mid_block_grows_and_requantizes(dtype, kv_heads, dim):
    """Block 5 holds 6 tokens; a chunk at offset 6 with a larger range grows its scale: the 6 earlier
    rows are requantized (checked to change), in every head."""
    cache = _random_cache(kv_heads, dim)
    k, v = _rows(6, kv_heads, dim, dtype, seed=3)
    cache = _assert_same_write(cache, 0, k, v, torch.arange(5 * BS, 5 * BS + 6))
    k, v = _rows(14, kv_heads, dim, dtype, seed=4, magnitude=10.0)
    after = _assert_same_write(cache, 0, k, v, torch.arange(5 * BS + 6, 6 * BS + 4))
    assert not torch.equal(after[5, 0, :, :6], cache[5, 0, :, :6])  # the requantize path ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim", SHAPES)
def test_decode_steps_of_many_sequences(dtype, kv_heads, dim):
    """40 steps of one token for each of 32 sequences (own blocks, different fill levels, ranges that
    grow now and then): rows of one call in 32 different blocks, fresh blocks started mid-run."""
    num_seqs = 32
    cache = _random_cache(kv_heads, dim, num_blocks=num_seqs * 4 + 1)
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 25, (num_seqs,), generator=gen)  # + 40 steps fits 4 blocks
    tables = (torch.randperm(num_seqs * 4, generator=gen) + 1).view(num_seqs, 4)
    for step in range(40):
        pos = lens + step
        slots = tables[torch.arange(num_seqs), pos // BS] * BS + pos % BS
        k, v = _rows(num_seqs, kv_heads, dim, dtype, seed=100 + step, magnitude=1.0 + (step % 7))
        cache = _assert_same_write(cache, 2, k, v, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_reused_block_ignores_its_stale_scale(dtype):
    """A block freed and started again (a write at offset 0) with a far smaller range than it held."""
    cache = _random_cache(*SMOLLM2)
    kv_quant.scales_view(cache)[7, 1] = 50.0  # the stale scale of its previous owner
    k, v = _rows(5, *SMOLLM2, dtype, seed=6, magnitude=0.01)
    got = _assert_same_write(cache, 1, k, v, torch.arange(7 * BS, 7 * BS + 5))
    assert kv_quant.scales_view(got)[7, 1].max() < 1e-3
    # the offset-0 row need not come first in the call: the block is fresh all the same
    _assert_same_write(cache, 1, k, v, torch.tensor([7 * BS + 3, 7 * BS + 1, 7 * BS, 7 * BS + 2, 7 * BS + 4]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,dim", SHAPES)
def test_all_zero_rows(dtype, kv_heads, dim):
    """Zeros into a fresh block (the scale becomes 2^-100) and into a used one (its scale stays)."""
    cache = _random_cache(kv_heads, dim)
    zeros = torch.zeros(3, kv_heads, dim, dtype=dtype)
    got = _assert_same_write(cache, 0, zeros, zeros, torch.arange(2 * BS, 2 * BS + 3))
    assert (kv_quant.scales_view(got)[2, 0] == 2.0 ** -100).all()
    _assert_same_write(cache, 0, zeros, zeros, torch.arange(3 * BS + 4, 3 * BS + 7))


def test_ties_round_half_to_even():
    """Scale exactly 1 (amax 127): 2.5 -> 2, -3.5 -> -4, 0.5 -> 0, as torch.round, not away from zero."""
    cache = torch.zeros(2, 1, 2, BS + 1, 1, 8, dtype=torch.int8)
    row = torch.tensor([[[127.0, 2.5, -3.5, 0.5, 1.5, -0.5, 126.5, -2.5]]])
    got = _assert_same_write(cache, 0, row, row, torch.tensor([BS]))
    assert got[1, 0, 0, 0, 0].tolist() == [127, 2, -4, 0, 2, 0, 126, -2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_one_block_not_adjacent_in_the_call(dtype):
    """Two sequences' rows interleaved (a block's rows apart in the call): scales over all of them."""
    cache = _random_cache(*SMOLLM2)
    slots = torch.tensor([3 * BS + 2, 9 * BS, 3 * BS + 3, 9 * BS + 1, 3 * BS + 4, 11 * BS + 15])
    k, v = _rows(6, *SMOLLM2, dtype, seed=7, magnitude=4.0)
    _assert_same_write(cache, 1, k, v, slots)


def test_strided_views_of_a_fused_projection():
    """k and v as the model passes them: views of one [N, (H + 2 KVH) * D] qkv output (row-strided)."""
    kvh, d, heads = *SMOLLM2, 9
    qkv = torch.randn(20, (heads + 2 * kvh) * d, generator=torch.Generator().manual_seed(8)).bfloat16()
    _, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    k, v = k.view(20, kvh, d), v.view(20, kvh, d)
    assert not v.is_contiguous()
    _assert_same_write(_random_cache(*SMOLLM2), 2, k, v, torch.arange(4 * BS + 9, 4 * BS + 29))


def test_torch_ops_dispatches_int8_to_the_c_write():
    """torch_ops.write_kv (what the model calls) writes INT8 through the kernel: same bytes as kv_quant."""
    cache = _random_cache(*SMOLLM2)
    k, v = _rows(17, *SMOLLM2, torch.bfloat16, seed=9)
    slots = torch.arange(BS - 1, 2 * BS)
    assert cpu_kv_write.supports(cache, k, v)  # (else both paths below are kv_quant's)
    want = cache.clone()
    kv_quant.write_kv(want, 0, k, v, slots)
    torch_ops.write_kv(cache, 0, k, v, slots)
    assert torch.equal(cache, want)


def test_what_it_does_not_take_goes_to_the_torch_path():
    """FP8 caches, fp16 inputs and out-of-range slots: False, nothing written (the caller runs kv_quant)."""
    k, v = _rows(2, *STORIES, torch.float32, seed=10)
    fp8 = torch.zeros(4, LAYERS, 2, BS + 1, *STORIES, dtype=torch.float8_e4m3fn)
    assert not cpu_kv_write.write_kv(fp8, 0, k, v, torch.tensor([0, 1]))
    cache = _random_cache(*STORIES, num_blocks=4)
    before = cache.clone()
    assert not cpu_kv_write.write_kv(cache, 0, k.half(), v.half(), torch.tensor([0, 1]))
    assert not cpu_kv_write.write_kv(cache, 0, k, v, torch.tensor([0, 4 * BS]))  # block 4 of 4
    assert not cpu_kv_write.write_kv(cache, 0, k, v, torch.tensor([-1, 0]))
    assert torch.equal(cache, before)


# ---- an engine on the kernel against one on the torch path --------------------------------------

@pytest.fixture(scope="module")
def checkpoint():
    from pdserve.runtime.loader import load_checkpoint

    return load_checkpoint(STORIES_GGUF)


def _generate(checkpoint, dtype: str, c_write: bool) -> tuple[list[list[int]], torch.Tensor]:
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.sampling_params import SamplingParams

    before = cpu_kv_write.ENABLED
    cpu_kv_write.ENABLED = c_write
    try:
        engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64, dtype="int8"),
                                                                 dtype=dtype))
        rows = torch.zeros(1, *engine.kv_cache.shape[4:], dtype=getattr(torch, dtype))  # [1, KVH, D]
        assert cpu_kv_write.supports(engine.kv_cache, rows, rows) == c_write  # the model's writes take that path
        tok = checkpoint.tokenizer
        prompts = [tok.encode(p) for p in ("Once upon a time", "The little dog ran to the park and saw",
                                           "Lily had a red ball. One day", "Tom")]
        seqs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        return [s.output_ids for s in seqs], engine.kv_cache.clone()
    finally:
        cpu_kv_write.ENABLED = before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_engine_serves_the_same_with_the_kernel(checkpoint, dtype):
    """Prefill and batched decode (4 sequences, 24 greedy tokens): the same tokens and, after it all,
    the same cache bytes as with every write on kv_quant's torch path."""
    tokens, cache = _generate(checkpoint, dtype, c_write=True)
    want_tokens, want_cache = _generate(checkpoint, dtype, c_write=False)
    assert tokens == want_tokens
    assert torch.equal(cache, want_cache)


def test_all_position_logits_are_identical(checkpoint):
    """One 90-token sequence through the runtime forward on an INT8 cache: identical logits."""
    from pdserve.commands.quant_eval import sequence_logits
    from pdserve.runtime.engine import Engine

    model = Engine.from_checkpoint(checkpoint).runner.model
    ids = checkpoint.tokenizer.encode("Once upon a time there was a little girl who loved to play outside. " * 6)[:90]
    got = sequence_logits(model, ids, kv_dtype="int8")
    cpu_kv_write.ENABLED = False
    try:
        want = sequence_logits(model, ids, kv_dtype="int8")
    finally:
        cpu_kv_write.ENABLED = True
    assert torch.equal(got, want)


def test_a_failed_build_writes_through_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that fails
    monkeypatch.setattr(cpu_attention, "PORTABLE", tmp_path / "none.so")  # nor a portable build
    cpu_attention.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
            assert cpu_attention.library() is None
        assert "INT8 KV write" in caplog.text
        cache = _random_cache(*SMOLLM2)
        k, v = _rows(9, *SMOLLM2, torch.float32, seed=11, magnitude=5.0)
        slots = torch.arange(3 * BS + 10, 3 * BS + 19)
        assert not cpu_kv_write.write_kv(cache.clone(), 0, k, v, slots)
        want = cache.clone()
        kv_quant.write_kv(want, 0, k, v, slots)
        torch_ops.write_kv(cache, 0, k, v, slots)
        assert torch.equal(cache, want)
    finally:
        cpu_attention.library.cache_clear()  # the next call, outside this test's environment, loads the real build
