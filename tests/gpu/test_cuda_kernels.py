"""Each CuPy CUDA kernel against its torch reference, on a GPU.

The attention references run in fp32 on the fp32-upcast inputs (the same 16-bit values the
kernel reads), so the tolerances below measure the kernel's own error: fp32 accumulation
plus one rounding of the output, versus the reference's one rounding.

Tolerances (atol, rtol) per dtype, for outputs of magnitude up to ~3:
  float32  (1e-4, 1e-4)   approximate __expf in the softmax
  float16  (2e-3, 4e-3)   ~1 ulp of fp16 at 2..4 on both sides
  bfloat16 (1.6e-2, 3e-2) ~1 ulp of bf16 at 2..4 on both sides
Row kernels (norms, RoPE, SiLU) are compared with the reference in the same dtype, which
rounds at each torch op: they may differ by one rounding of the result.

The grid (batch 1-64, context 1-8192, head dims 64 / 128, GQA 1 / 4 / 8, three dtypes) is a
covering selection rather than the full product so that the file runs in about a minute or
two on an H200 (first run includes NVRTC compiles; CuPy caches them on disk).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import require_gpu

require_gpu()

from pdserve.runtime.kernels import cuda_ops, torch_ops, torch_varlen  # noqa: E402

DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2)}
ROW_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
LAYERS, LAYER = 2, 1  # a non-zero layer exercises the layer offset


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _close(got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    atol, rtol = tol
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _paged_setup(context_lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, gen: torch.Generator, spare_blocks: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache with the sequences' blocks scattered randomly, and the padded block tables."""
    need = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(need) + spare_blocks
    cache = torch.randn(num_blocks, LAYERS, 2, block_size, kv_heads, head_dim, generator=gen,
                        device=DEV).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=DEV).tolist()
    width, used, rows = max(max(need), 1), 0, []
    for n in need:
        rows.append(perm[used:used + n] + [0] * (width - n))
        used += n
    return cache, torch.tensor(rows, dtype=torch.int64, device=DEV)


# ---- paged decode attention ---------------------------------------------------------------------

# (batch, max context, block size): long single sequences, mixed batches, large batches.
DECODE_SHAPES = [
    (1, 1, 16), (1, 17, 16), (1, 2048, 16), (1, 8192, 16),
    (3, 300, 8), (8, 512, 16), (8, 2048, 32), (32, 1000, 16), (64, 128, 16), (64, 8192, 16),
]
# (head dim, query heads, kv heads): GQA ratios 1, 4, 8.
DECODE_HEADS = [(128, 32, 8), (128, 32, 4), (64, 16, 16), (64, 8, 2), (128, 64, 8)]


def _decode_cases() -> list[tuple]:
    """Every shape with every dtype; head configs rotate over the shapes so each is covered."""
    cases = []
    for i, (b, ctx, bs) in enumerate(DECODE_SHAPES):
        for j, dtype in enumerate(DTYPES):
            d, h, kvh = DECODE_HEADS[(i + j) % len(DECODE_HEADS)]
            cases.append(pytest.param(b, ctx, bs, d, h, kvh, dtype,
                                      id=f"b{b}-ctx{ctx}-bs{bs}-d{d}-h{h}-kv{kvh}-{_name(dtype)}"))
    return cases


@pytest.mark.parametrize(("batch", "max_ctx", "block_size", "head_dim", "heads", "kv_heads", "dtype"),
                         _decode_cases())
def test_paged_decode_attention(batch: int, max_ctx: int, block_size: int, head_dim: int, heads: int,
                                kv_heads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEV).manual_seed(batch * 7919 + max_ctx)
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device=DEV).tolist()
    lens[0] = max_ctx  # the longest context always occurs
    cache, tables = _paged_setup(lens, block_size, kv_heads, head_dim, dtype, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=DEV).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEV)
    scale = head_dim ** -0.5
    got = cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, scale)
    want = torch_ops.paged_decode_attention(q.float(), cache.float(), LAYER, tables, ctx, scale)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, want, TOL[dtype], "decode")


def test_paged_decode_attention_padded_table_and_zero_context() -> None:
    """A table much wider than the contexts (many empty partitions) and a context of 0."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    lens = [5, 1, 0, 40]
    cache, tables = _paged_setup([max(c, 1) for c in lens], 16, 2, 128, torch.float16, gen)
    tables = torch.cat([tables, torch.zeros(4, 200, dtype=torch.int64, device=DEV)], dim=1)
    q = torch.randn(4, 8, 128, generator=gen, device=DEV).half()
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEV)
    got = cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, 0.1)
    want = torch_ops.paged_decode_attention(q.float(), cache.float(), LAYER, tables, ctx, 0.1)
    keep = torch.tensor([0, 1, 3], device=DEV)
    _close(got[keep], want[keep], TOL[torch.float16], "decode padded")
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize("head_dim", [96, 256])
def test_paged_decode_attention_other_head_dims(head_dim: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(head_dim)
    lens = [700, 3]
    cache, tables = _paged_setup(lens, 16, 2, head_dim, torch.bfloat16, gen)
    q = torch.randn(2, 8, head_dim, generator=gen, device=DEV).bfloat16()
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEV)
    got = cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, 0.1)
    want = torch_ops.paged_decode_attention(q.float(), cache.float(), LAYER, tables, ctx, 0.1)
    _close(got, want, TOL[torch.bfloat16], f"decode d{head_dim}")


# ---- prefill attention --------------------------------------------------------------------------

# (new tokens, context): no prefix, prefix, chunk boundaries around the 32-row / 16-key tiles.
PREFILL_SPANS = [(1, 1), (17, 17), (32, 33), (33, 100), (300, 300), (64, 2048), (1024, 8192)]
PREFILL_HEADS = [(128, 32, 8), (64, 16, 2), (128, 8, 8)]  # GQA 4, 8, 1


def _prefill_cases() -> list[tuple]:
    cases = []
    for i, (n, ctx) in enumerate(PREFILL_SPANS):
        for j, dtype in enumerate(DTYPES):
            d, h, kvh = PREFILL_HEADS[(i + j) % len(PREFILL_HEADS)]
            cases.append(pytest.param(n, ctx, d, h, kvh, dtype, id=f"n{n}-ctx{ctx}-d{d}-h{h}-kv{kvh}-{_name(dtype)}"))
    return cases


@pytest.mark.parametrize(("n", "ctx", "head_dim", "heads", "kv_heads", "dtype"), _prefill_cases())
def test_prefill_attention(n: int, ctx: int, head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEV).manual_seed(n * 31 + ctx)
    cache, tables = _paged_setup([ctx], 16, kv_heads, head_dim, dtype, gen)
    table = torch.cat([tables[0], torch.zeros(3, dtype=torch.int64, device=DEV)])  # padded row
    q = torch.randn(n, heads, head_dim, generator=gen, device=DEV).to(dtype)
    scale = head_dim ** -0.5
    got = cuda_ops.prefill_attention(q, cache, LAYER, table, ctx, scale)
    want = torch_ops.prefill_attention(q.float(), cache.float(), LAYER, table, ctx, scale)
    _close(got, want, TOL[dtype], "prefill")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), [(128, 32, 8), (64, 16, 2)])
def test_prefill_attention_varlen(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(5)
    spans = [(5, 5), (1, 40), (0, 10), (100, 130), (64, 64), (257, 1000), (33, 33)]
    cache, tables = _paged_setup([c for _, c in spans], 16, kv_heads, head_dim, dtype, gen)
    lens = torch.tensor([n for n, _ in spans], device=DEV)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=DEV), torch.cumsum(lens, 0)])
    ctx = torch.tensor([c for _, c in spans], dtype=torch.int64, device=DEV)
    q = torch.randn(int(cu[-1]), heads, head_dim, generator=gen, device=DEV).to(dtype)
    got = cuda_ops.prefill_attention_varlen(q, cache, LAYER, cu, ctx, tables, 0.125)
    want = torch_varlen.prefill_attention_varlen(q.float(), cache.float(), LAYER, cu, ctx, tables, 0.125)
    _close(got, want, TOL[dtype], "prefill varlen")


def test_prefill_attention_head_dim_256() -> None:
    """Shared memory beyond 48 KiB: the kernel opts in."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    cache, tables = _paged_setup([200], 16, 2, 256, torch.float16, gen)
    q = torch.randn(70, 4, 256, generator=gen, device=DEV).half()
    got = cuda_ops.prefill_attention(q, cache, LAYER, tables[0], 200, 0.06)
    want = torch_ops.prefill_attention(q.float(), cache.float(), LAYER, tables[0], 200, 0.06)
    _close(got, want, TOL[torch.float16], "prefill d256")


# ---- cache write, norms, RoPE, SiLU -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_write_kv_from_fused_qkv_views(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEV).manual_seed(1)
    nb, bs, kvh, d, h, n = 20, 16, 4, 128, 8, 37
    cache = torch.randn(nb, LAYERS, 2, bs, kvh, d, generator=gen, device=DEV).to(dtype)
    qkv = torch.randn(n, (h + 2 * kvh) * d, generator=gen, device=DEV).to(dtype)
    _, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    k, v = k.view(n, kvh, d), v.view(n, kvh, d)  # row-strided views, as the model passes them
    slots = torch.randperm(nb * bs, generator=gen, device=DEV)[:n]
    want = cache.clone()
    torch_ops.write_kv(want, LAYER, k, v, slots)
    cuda_ops.write_kv(cache, LAYER, k, v, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, want)


def test_write_kv_skips_negative_slots() -> None:
    cache = torch.zeros(4, LAYERS, 2, 8, 2, 64, dtype=torch.float16, device=DEV)
    k = torch.ones(3, 2, 64, dtype=torch.float16, device=DEV)
    slots = torch.tensor([3, -1, 9], dtype=torch.int64, device=DEV)
    cuda_ops.write_kv(cache, 0, k, k * 2, slots)
    assert cache[0, 0, 0, 3].eq(1).all() and cache[1, 0, 1, 1].eq(2).all()
    assert cache.sum().item() == (2 * 64) * 2 * (1 + 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("hidden", [64, 4096, 5120])
def test_rms_norms(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(hidden)
    x = torch.randn(33, hidden, generator=gen, device=DEV).to(dtype)
    r = torch.randn(33, hidden, generator=gen, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEV)).to(dtype)
    _close(cuda_ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), ROW_TOL[dtype], "rms_norm")
    out, summed = cuda_ops.add_rms_norm(x, r, w, 1e-5)
    want_out, want_summed = torch_ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, want_summed)
    _close(out, want_out, ROW_TOL[dtype], "add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_on_fused_qkv_views(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(head_dim)
    n, h, kvh = 29, 8, 2
    cos, sin = (t.to(DEV) for t in torch_ops.rope_cos_sin(head_dim, 4096, 500000.0))
    qkv = torch.randn(n, (h + 2 * kvh) * head_dim, generator=gen, device=DEV).to(dtype)
    q, k, _ = qkv.split([h * head_dim, kvh * head_dim, kvh * head_dim], dim=-1)
    q, k = q.view(n, h, head_dim), k.view(n, kvh, head_dim)
    pos = torch.randint(0, 4096, (n,), generator=gen, device=DEV)
    got_q, got_k = cuda_ops.apply_rope(q, k, pos, cos, sin)
    want_q, want_k = torch_ops.apply_rope(q, k, pos, cos, sin)
    _close(got_q, want_q, ROW_TOL[dtype], "rope q")
    _close(got_k, want_k, ROW_TOL[dtype], "rope k")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(17, 2 * 1000, generator=gen, device=DEV).to(dtype)
    _close(cuda_ops.silu_and_mul(x), torch_ops.silu_and_mul(x), ROW_TOL[dtype], "silu_and_mul")


# ---- argument checks ----------------------------------------------------------------------------


def test_rejects_bad_arguments() -> None:
    cache = torch.zeros(4, 1, 2, 16, 2, 64, dtype=torch.float16, device=DEV)
    tables = torch.zeros(2, 1, dtype=torch.int64, device=DEV)
    ctx = torch.ones(2, dtype=torch.int64, device=DEV)
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="dtype"):
        cuda_ops.paged_decode_attention(q.float(), cache, 0, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="int64"):
        cuda_ops.paged_decode_attention(q, cache, 0, tables.int(), ctx, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_ops.paged_decode_attention(q.transpose(0, 1).contiguous().transpose(0, 1), cache, 0, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cuda_ops.paged_decode_attention(q[:, :3].contiguous(), cache, 0, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="layer"):
        cuda_ops.paged_decode_attention(q, cache, 1, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="context_len"):
        cuda_ops.prefill_attention(q, cache, 0, tables[0], 1, 1.0)


# ---- the model's call pattern -------------------------------------------------------------------


def test_runs_on_a_side_stream() -> None:
    """Launches follow torch's current stream (no implicit sync with the default stream)."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    cache, tables = _paged_setup([300, 20], 16, 2, 128, torch.bfloat16, gen)
    q = torch.randn(2, 16, 128, generator=gen, device=DEV).bfloat16()
    ctx = torch.tensor([300, 20], dtype=torch.int64, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, 0.1)
    torch.cuda.current_stream().wait_stream(side)
    want = torch_ops.paged_decode_attention(q.float(), cache.float(), LAYER, tables, ctx, 0.1)
    _close(got, want, TOL[torch.bfloat16], "side stream")


def test_decode_step_captures_in_a_cuda_graph() -> None:
    """Warm up once (NVRTC compile, module load), capture, then replay on new inputs."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    lens = [900, 33, 1]
    cache, tables = _paged_setup(lens, 16, 2, 128, torch.float16, gen)
    q = torch.randn(3, 16, 128, generator=gen, device=DEV).half()
    ctx = torch.tensor(lens, dtype=torch.int64, device=DEV)
    cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, 0.1)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_ops.paged_decode_attention(q, cache, LAYER, tables, ctx, 0.1)
    q.copy_(torch.randn(3, 16, 128, generator=gen, device=DEV).half())
    ctx.copy_(torch.tensor([500, 34, 2], device=DEV))
    graph.replay()
    want = torch_ops.paged_decode_attention(q.float(), cache.float(), LAYER, tables, ctx, 0.1)
    _close(out, want, TOL[torch.float16], "graph replay")
