"""The C prefill attention (pdserve.runtime.kernels.cpu_attention.paged_prefill_attention: a prompt
chunk's rows as queries of the decode kernel over one table) against torch's prefill path
(torch_ops.prefill_attention_torch) on the same cache: whole prompts and chunks after a cached prefix,
bf16, fp32 and INT8 caches, block sizes, one and two threads; each row as the decode kernel's query."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.kernels import cpu_attention, kv_quant, torch_ops

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the kernel cannot be built")


def _prompt(dtype: torch.dtype, n: int, ctx: int, heads: int = 9, kv_heads: int = 3, dim: int = 64,
            block_size: int = 16, seed: int = 0):
    """A cache of `ctx` tokens on shuffled blocks (the table padded past them) and the queries of its
    last n."""
    gen = torch.Generator().manual_seed(seed)
    used = -(-ctx // block_size)
    cache = torch.randn(used + 4, 2, 2, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.cat([torch.randperm(used + 3, generator=gen)[:used] + 1, torch.zeros(2, dtype=torch.int64)])
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    return q, cache, table


def _on_threads(threads: int, q: torch.Tensor, cache: torch.Tensor, layer: int, table: torch.Tensor, ctx: int
                ) -> torch.Tensor:
    """paged_prefill_attention (scale 0.125) with torch's thread count set to `threads` for the call."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_attention.paged_prefill_attention(q, cache, layer, table, ctx, 0.125)
    finally:
        torch.set_num_threads(before)


CHUNKS = [(1, 1), (16, 16), (200, 200), (37, 90), (5, 261), (1, 64)]  # (n, ctx): whole prompts, chunks after a prefix


@pytest.mark.parametrize("n,ctx", CHUNKS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_fp32_equals_the_torch_path(n, ctx, block_size):
    q, cache, table = _prompt(torch.float32, n, ctx, block_size=block_size)
    got = cpu_attention.paged_prefill_attention(q, cache, 1, table, ctx, 0.125)
    torch.testing.assert_close(got, torch_ops.prefill_attention_torch(q, cache, 1, table, ctx, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,ctx", CHUNKS)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_is_as_close_to_fp32_as_the_torch_path(n, ctx, threads):
    q, cache, table = _prompt(torch.bfloat16, n, ctx, seed=1)
    got = _on_threads(threads, q, cache, 0, table, ctx)
    reference = torch_ops.prefill_attention_torch(q.float(), cache.float(), 0, table, ctx, 0.125)
    theirs = torch_ops.prefill_attention_torch(q, cache, 0, table, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ours, torchs = (got.float() - reference).abs().max(), (theirs.float() - reference).abs().max()
    assert ours <= torchs + 2 ** -8 * reference.abs().max(), (ours, torchs)


@pytest.mark.parametrize("n,ctx", [(24, 70), (1, 1), (8, 8), (9, 40), (17, 17), (200, 261)])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 5),
                                                           (9, 3, 64, 32), (6, 3, 48, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_the_decode_kernels_query_over_its_own_context(n, ctx, heads, kv_heads, dim, block_size, threads):
    """Row i of a chunk of n after a prefix: the bits of one decode query at context ctx - n + i + 1, whether
    the rows ran in tiles sharing each run of keys and values (prefill_attention.c: AVX512-BF16, head dims a
    multiple of 32) or one by one (a head dim of 48, other CPUs); tiles of 8 rows, pairs in the values pass,
    runs cut short by a block of 5 or by a row's context, two runs a block of 32, two threads."""
    q, cache, table = _prompt(torch.bfloat16, n, ctx, heads, kv_heads, dim, block_size, seed=2)
    rows = _on_threads(threads, q, cache, 1, table, ctx)
    for i in range(n):
        one = cpu_attention.paged_decode_attention(q[i:i + 1], cache, 1, table[None], torch.tensor([ctx - n + i + 1]),
                                                   0.125)
        assert torch.equal(rows[i], one[0])


def test_the_tiles_run_wherever_the_cpu_has_avx512_bf16():
    """Where the bf16 dot kernels are built, a bf16 prompt takes the tiles (not silently the per-row loop)."""
    q, cache, table = _prompt(torch.bfloat16, 12, 40, seed=5)
    lens = torch.arange(29, 41, dtype=torch.int64)
    scores = torch.empty(12, 9, table.shape[0] * 16)
    tiles = cpu_attention._prefill_tiles(q, cache, 0, table, lens, scores, 0.125)
    assert (tiles is not None) == bool(cpu_attention.library().bf16_dot_available())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_int8_cache_equals_the_torch_path_over_the_same_codes(dtype):
    n, ctx, bs = 30, 75, 16
    q, cache, table = _prompt(dtype, n, ctx, seed=3)
    codes = torch.zeros(cache.shape[0], 2, 2, bs + 1, 3, 64, dtype=torch.int8)
    slots = torch.stack([table[t // bs] * bs + t % bs for t in range(ctx)])
    blocks, offsets = slots // bs, slots % bs
    for layer in range(2):
        kv_quant.write_kv(codes, layer, cache[blocks, layer, 0, offsets], cache[blocks, layer, 1, offsets], slots)
    got = cpu_attention.paged_prefill_attention(q, codes, 1, table, ctx, 0.125)
    want = torch_ops.prefill_attention_torch(q.float(), codes, 1, table, ctx, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_the_runtime_takes_it_where_it_applies_and_torch_elsewhere():
    """torch_ops.prefill_attention: the kernel's bits for a bf16 cache; a float16 one (no kernel) torch's."""
    q, cache, table = _prompt(torch.bfloat16, 12, 40, seed=4)
    assert torch.equal(torch_ops.prefill_attention(q, cache, 0, table, 40, 0.125),
                       cpu_attention.paged_prefill_attention(q, cache, 0, table, 40, 0.125))
    half = cache.half()
    assert cpu_attention.paged_prefill_attention(q.half(), half, 0, table, 40, 0.125) is None
    assert torch.equal(torch_ops.prefill_attention(q.half(), half, 0, table, 40, 0.125),
                       torch_ops.prefill_attention_torch(q.half(), half, 0, table, 40, 0.125))
