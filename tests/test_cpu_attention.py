"""The C decode attention over the paged cache (pdserve.runtime.kernels.cpu_attention) against
torch's gather + SDPA path computed in fp32 on the same cache, and its fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.runtime.kernels import cpu_attention
from pdserve.runtime.kernels.torch_ops import paged_decode_attention, paged_decode_attention_torch

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the kernel cannot be built")


def _case(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, dim: int, block_size: int = 16,
          layers: int = 3, seed: int = 0):
    """A random cache with `batch` sequences of different lengths on shuffled blocks (tables padded)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * block_size, (batch,), generator=gen)
    widest = int(-(-lens.max() // block_size))
    num_blocks = batch * widest + 1
    cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(batch, widest, dtype=torch.int64)  # padded with block 0
    for b in range(batch):
        used = int(-(-lens[b] // block_size))
        tables[b, :used] = ids[b * widest:b * widest + used]
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    return q, cache, tables, lens


SHAPES = [(9, 3, 64), (8, 4, 8), (4, 4, 32), (6, 1, 40), (6, 2, 128), (16, 2, 64)]  # SmolLM2, stories260K, MHA,
# MQA with a ragged dim; head dim 128, GQA 3 (registers) and 8 (more accumulators than registers: the portable pass)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(*shape, 16) for shape in SHAPES] + [
    (9, 3, 64, 1), (9, 3, 64, 5), (9, 3, 64, 32), (24, 2, 64, 16), (12, 1, 128, 16)])  # fp32 AVX2 scores: tiles of
# up to 8 rows of a block; values: GQA 12 (12 sums a pass) and MQA of 12 heads at head dim 128 (one chunk a pass)
def test_float32_equals_the_torch_path(heads, kv_heads, dim, block_size):
    q, cache, tables, lens = _case(torch.float32, 7, heads, kv_heads, dim, block_size=block_size)
    for layer in range(cache.shape[1]):
        got = cpu_attention.paged_decode_attention(q, cache, layer, tables, lens, dim ** -0.5)
        want = paged_decode_attention_torch(q, cache, layer, tables, lens, dim ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(*shape, 16) for shape in SHAPES] + [
    (9, 3, 64, 1), (9, 3, 64, 8), (9, 3, 64, 32)])  # the AVX512-BF16 scores take runs of up to 16 rows of a block
def test_bfloat16_is_as_close_to_fp32_as_the_torch_path(heads, kv_heads, dim, block_size):
    q, cache, tables, lens = _case(torch.bfloat16, 7, heads, kv_heads, dim, block_size=block_size, seed=1)
    reference = paged_decode_attention_torch(q.float(), cache.float(), 1, tables, lens, dim ** -0.5)
    got = cpu_attention.paged_decode_attention(q, cache, 1, tables, lens, dim ** -0.5)
    torch_bf16 = paged_decode_attention_torch(q, cache, 1, tables, lens, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    ours, theirs = (got.float() - reference).abs().max(), (torch_bf16.float() - reference).abs().max()
    assert ours <= theirs + 2 ** -8 * reference.abs().max(), (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequence_gets_the_same_bits_in_any_batch(threads, dtype):
    """Per-sequence math in a fixed order: batched (and split over threads) equals alone, bit for bit."""
    q, cache, tables, lens = _case(dtype, 12, 9, 3, 64, seed=2)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = cpu_attention.paged_decode_attention(q, cache, 0, tables, lens, 0.125)
        for b in range(len(lens)):
            alone = cpu_attention.paged_decode_attention(q[b:b + 1], cache, 0, tables[b:b + 1, :1 + int(lens[b] - 1) // 16],
                                                         lens[b:b + 1], 0.125)
            assert torch.equal(alone, batched[b:b + 1]), b
    finally:
        torch.set_num_threads(before)


def test_other_formats_run_the_torch_path():
    q, cache, tables, lens = _case(torch.float16, 3, 8, 4, 8)
    assert cpu_attention.paged_decode_attention(q, cache, 0, tables, lens, 0.3) is None
    assert torch.equal(paged_decode_attention(q, cache, 0, tables, lens, 0.3),
                       paged_decode_attention_torch(q, cache, 0, tables, lens, 0.3))


def test_a_failed_build_falls_back_with_one_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that fails
    cpu_attention.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
            assert cpu_attention.library() is None
        assert "CPU paged attention kernel unavailable" in caplog.text
        q, cache, tables, lens = _case(torch.float32, 2, 8, 4, 8)
        assert torch.equal(paged_decode_attention(q, cache, 0, tables, lens, 0.3),
                           paged_decode_attention_torch(q, cache, 0, tables, lens, 0.3))
    finally:
        cpu_attention.library.cache_clear()  # the next call, outside this test's environment, loads the real build


def _int8_cache(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, dim: int, seed: int = 3,
                block_size: int = 16):
    """An INT8 cache written by kv_quant.write_kv (codes plus a scale row per block) from a float one."""
    from pdserve.runtime.kernels import kv_quant

    q, cache, tables, lens = _case(dtype, batch, heads, kv_heads, dim, block_size=block_size, seed=seed)
    nb, layers, _, bs, _, _ = cache.shape
    codes = torch.zeros(nb, layers, 2, bs + 1, kv_heads, dim, dtype=torch.int8)
    slots = torch.cat([tables[b, t // bs] * bs + t % bs for b in range(batch) for t in torch.arange(int(lens[b]))[None]])
    for layer in range(layers):
        ids, offsets = slots // bs, slots % bs
        kv_quant.write_kv(codes, layer, cache[ids, layer, 0, offsets], cache[ids, layer, 1, offsets], slots)
    return q, codes, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES[:3])
def test_int8_codes_equal_the_torch_path_over_the_same_codes(dtype, heads, kv_heads, dim):
    q, codes, tables, lens = _int8_cache(dtype, 6, heads, kv_heads, dim)
    got = cpu_attention.paged_decode_attention(q, codes, 2, tables, lens, dim ** -0.5)
    assert got is not None and got.dtype == dtype
    want = paged_decode_attention_torch(q.float(), codes, 2, tables, lens, dim ** -0.5)  # dequantized, fp32
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_codes_under_bf16_queries_at_any_block_size_and_batch(block_size, threads):
    """bf16 queries over INT8 codes (paged_attention_i8.c's AVX512-BF16 passes where the CPU has them:
    runs of up to 16 keys of a block, the scale after each sum): close to the dequantized cache's fp32
    attention, and a sequence's bits the same alone as in the batch, on one thread or split over two."""
    q, codes, tables, lens = _int8_cache(torch.bfloat16, 7, 9, 3, 64, seed=5, block_size=block_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = cpu_attention.paged_decode_attention(q, codes, 1, tables, lens, 0.125)
        want = paged_decode_attention_torch(q.float(), codes, 1, tables, lens, 0.125)
        torch.testing.assert_close(batched.float(), want, rtol=2 ** -7, atol=2 ** -7)
        for b in range(len(lens)):
            used = 1 + int(lens[b] - 1) // block_size
            alone = cpu_attention.paged_decode_attention(q[b:b + 1], codes, 1, tables[b:b + 1, :used], lens[b:b + 1],
                                                         0.125)
            assert torch.equal(alone, batched[b:b + 1]), b
    finally:
        torch.set_num_threads(before)


def test_a_portable_build_serves_where_no_compiler_is(tmp_path, monkeypatch):
    """An image without a compiler loads the package's portable build (made by the Dockerfile)."""
    portable = cpu_attention.build_portable(tmp_path / "portable.so")
    monkeypatch.setattr(cpu_attention, "PORTABLE", portable)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    cpu_attention.library.cache_clear()
    try:
        assert cpu_attention.library() is not None
        q, cache, tables, lens = _case(torch.float32, 3, 9, 3, 64)
        torch.testing.assert_close(cpu_attention.paged_decode_attention(q, cache, 0, tables, lens, 0.125),
                                   paged_decode_attention_torch(q, cache, 0, tables, lens, 0.125),
                                   rtol=1e-5, atol=1e-5)
    finally:
        cpu_attention.library.cache_clear()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_the_library_splits_work_on_torchs_own_openmp_runtime():
    """Built with -fopenmp, the library must bind to the libgomp torch loaded, not load a second one:
    two runtimes would keep two teams of threads that spin against each other on a small machine
    (kernels/cpu/threads.h). Fails if a torch wheel ships its libgomp under another soname. (Other
    packages' own renamed copies, sentencepiece's, are theirs.)"""
    mapped = {line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith("/libgomp.so.1")}
    assert len(mapped) == 1, mapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_span_of_kv_heads_equals_the_whole_call(dtype):
    """The one-call decode step splits one sequence's attention by kv heads (`paged_attention_*_heads`):
    heads [0, 1) then [1, 3) give the bits of [0, 3), which are the threaded entry point's."""
    import ctypes

    q, cache, tables, lens = _case(dtype, 3, 9, 3, 64, seed=4)
    kernel = "bf16_bf16" if dtype == torch.bfloat16 else "f32_f32"
    heads_of = getattr(cpu_attention.library(), f"paged_attention_{kernel}_heads")
    heads_of.restype = ctypes.c_int
    layers, block = cache.shape[1], cache.shape[3]
    chunk, t_pad = block * 3 * 64, tables.shape[1] * block
    for b in range(len(lens)):
        def attention(spans):
            out, scores = torch.zeros(9, 64, dtype=dtype), torch.zeros(9, t_pad)
            table, length = tables[b].contiguous(), lens[b:b + 1].contiguous()
            for g0, g1 in spans:
                sizes = (tables.shape[1], 9, 3, 64, block, layers * 2 * chunk, 2 * chunk, 3 * chunk, t_pad, g0, g1)
                assert heads_of(ctypes.c_void_p(q[b].data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                ctypes.c_void_p(scores.data_ptr()), ctypes.c_float(0.125),
                                ctypes.c_void_p(cache.data_ptr()), ctypes.c_void_p(table.data_ptr()),
                                ctypes.c_void_p(length.data_ptr()), *map(ctypes.c_int64, sizes)) == 0
            return out

        whole = attention([(0, 3)])
        assert torch.equal(attention([(0, 1), (1, 3)]), whole)
        threaded = cpu_attention.paged_decode_attention(q[b:b + 1], cache, 1, tables[b:b + 1], lens[b:b + 1], 0.125)
        assert torch.equal(whole, threaded[0])
