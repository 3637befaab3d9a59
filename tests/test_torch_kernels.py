"""The torch reference kernels against plain dense math, in fp32 on the CPU.

The CUDA kernels are tested against these references on a GPU (tests/gpu), so the references
themselves are pinned here to formulas written out independently: dense softmax attention
with an explicit causal mask and GQA repeat, a complex-number rotation for RoPE, and the
RMSNorm formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.runtime.kernels import torch_ops, torch_varlen

ATOL = 1e-5
RTOL = 1e-5


def _cache(num_blocks: int, layers: int, block_size: int, kv_heads: int, head_dim: int,
           gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=gen)


def _scattered_tables(context_lens: list[int], block_size: int, num_blocks: int,
                      gen: torch.Generator) -> torch.Tensor:
    """Block tables [B, MB] using distinct blocks in random order, padded with block 0."""
    need = [math.ceil(c / block_size) for c in context_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need)
    rows, used = [], 0
    for n in need:
        row = perm[used:used + n]
        used += n
        rows.append(row + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.int64)


def _dense_kv(kv_cache: torch.Tensor, layer: int, table: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one sequence, [ctx, KVH, D], read token by token from the paged cache."""
    bs = kv_cache.shape[3]
    k = torch.stack([kv_cache[table[t // bs], layer, 0, t % bs] for t in range(ctx)])
    v = torch.stack([kv_cache[table[t // bs], layer, 1, t % bs] for t in range(ctx)])
    return k, v


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v with GQA repeat, in float64.

    q: [n, H, D] at absolute positions q_positions [n]; k, v: [T, KVH, D] -> [n, H, D].
    """
    h, kvh = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(h // kvh, dim=1)  # [T, H, D]: head i uses kv head i // G
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * scale  # [H, n, T]
    mask = torch.arange(k.shape[0])[None, :] > q_positions[:, None]  # [n, T]: future keys
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), v).float()


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_matches_dense(heads: int, kv_heads: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    d, layers, layer = 32, 3, 1
    context_lens = [1, 7, block_size, block_size + 1, 50]
    cache = _cache(64, layers, block_size, kv_heads, d, gen)
    tables = _scattered_tables(context_lens, block_size, 64, gen)
    q = torch.randn(len(context_lens), heads, d, generator=gen)
    scale = d ** -0.5
    out = torch_ops.paged_decode_attention(q, cache, layer, tables, torch.tensor(context_lens), scale)
    for b, ctx in enumerate(context_lens):
        k, v = _dense_kv(cache, layer, tables[b].tolist(), ctx)
        want = dense_attention(q[b:b + 1], k, v, torch.tensor([ctx - 1]), scale)
        torch.testing.assert_close(out[b:b + 1], want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("n", "ctx"), [(1, 1), (5, 5), (11, 37), (16, 16), (3, 64)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("attend", [torch_ops.prefill_attention, torch_ops.prefill_attention_torch],
                         ids=["c-where-built", "torch"])
def test_prefill_attention_with_cached_prefix(n: int, ctx: int, heads: int, kv_heads: int, attend) -> None:
    gen = torch.Generator().manual_seed(1)
    d, bs, layer = 32, 8, 0
    cache = _cache(32, 2, bs, kv_heads, d, gen)
    table = _scattered_tables([ctx], bs, 32, gen)[0]
    # A longer table than needed: the reference must only read ceil(ctx / bs) blocks.
    table = torch.cat([table, torch.zeros(2, dtype=torch.int64)])
    q = torch.randn(n, heads, d, generator=gen)
    out = attend(q, cache, layer, table, ctx, 0.2)
    k, v = _dense_kv(cache, layer, table.tolist(), ctx)
    want = dense_attention(q, k, v, torch.arange(ctx - n, ctx), 0.2)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("n", [16, 200])
def test_prefill_attention_without_prefix_gives_the_masked_calls_bits(n: int) -> None:
    """A whole prompt (no cached prefix) takes is_causal with grouped heads; its bf16 output must
    be the bits of the masked call with repeated heads that chunks after a prefix take."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    cache = _cache(32, 1, bs, kv_heads, d, gen).bfloat16()
    table = _scattered_tables([n], bs, 32, gen)[0]
    q = torch.randn(n, heads, d, generator=gen).bfloat16()
    out = torch_ops.prefill_attention_torch(q, cache, 0, table, n, 0.125)
    k, v = (x.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0) for x in _dense_kv(cache, 0, table.tolist(), n))
    mask = torch.zeros(n, n, dtype=torch.bfloat16).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    masked = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                                              attn_mask=mask, scale=0.125)[0].transpose(0, 1)
    assert torch.equal(out, masked)
    want = dense_attention(q, *_dense_kv(cache, 0, table.tolist(), n), torch.arange(n), 0.125)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_prefill_attention_varlen_matches_dense() -> None:
    gen = torch.Generator().manual_seed(2)
    d, bs, layer, heads, kv_heads = 32, 4, 1, 6, 3
    spans = [(3, 3), (1, 9), (0, 5), (7, 20), (4, 4)]  # (new tokens, context) per sequence
    cache = _cache(48, 2, bs, kv_heads, d, gen)
    tables = _scattered_tables([c for _, c in spans], bs, 48, gen)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for n, _ in spans]), 0)), dtype=torch.int64)
    q = torch.randn(int(cu[-1]), heads, d, generator=gen)
    out = torch_varlen.prefill_attention_varlen(
        q, cache, layer, cu, torch.tensor([c for _, c in spans]), tables, 0.3)
    for s, (n, ctx) in enumerate(spans):
        if n == 0:
            continue
        k, v = _dense_kv(cache, layer, tables[s].tolist(), ctx)
        want = dense_attention(q[cu[s]:cu[s + 1]], k, v, torch.arange(ctx - n, ctx), 0.3)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], want, atol=ATOL, rtol=RTOL)


def test_write_kv_scatters_into_slots() -> None:
    gen = torch.Generator().manual_seed(3)
    nb, layers, bs, kvh, d, layer = 10, 3, 4, 2, 8, 2
    cache = _cache(nb, layers, bs, kvh, d, gen)
    before = cache.clone()
    slots = torch.randperm(nb * bs, generator=gen)[:7]
    k = torch.randn(7, kvh, d, generator=gen)
    v = torch.randn(7, kvh, d, generator=gen)
    torch_ops.write_kv(cache, layer, k, v, slots)
    expect = before.clone()
    for i, slot in enumerate(slots.tolist()):
        expect[slot // bs, layer, 0, slot % bs] = k[i]
        expect[slot // bs, layer, 1, slot % bs] = v[i]
    assert torch.equal(cache, expect)


def test_rope_matches_complex_rotation() -> None:
    gen = torch.Generator().manual_seed(4)
    n, heads, kv_heads, d, theta = 6, 4, 2, 16, 10000.0
    cos, sin = torch_ops.rope_cos_sin(d, 64, theta)
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(n, kv_heads, d, generator=gen)
    positions = torch.tensor([0, 1, 5, 17, 40, 63])
    q_rot, k_rot = torch_ops.apply_rope(q, k, positions, cos, sin)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # Rotate-half: element i pairs with i + d/2 as the complex number x_i + j x_{i+d/2},
        # turned by the angle pos * theta^(-2i/d).
        half = d // 2
        freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
        angle = positions.double()[:, None] * freqs[None, :]  # [n, d/2]
        z = torch.complex(x[..., :half].double(), x[..., half:].double())
        z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1).float()

    torch.testing.assert_close(q_rot, rotate(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_rot, rotate(k), atol=1e-5, rtol=1e-5)


def test_rms_norm_and_add_rms_norm() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 48, generator=gen)
    r = torch.randn(5, 48, generator=gen)
    w = torch.randn(48, generator=gen)
    eps = 1e-6
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(torch_ops.rms_norm(x, w, eps), want, atol=ATOL, rtol=RTOL)
    out, summed = torch_ops.add_rms_norm(x, r, w, eps)
    s = x + r
    torch.testing.assert_close(summed, s)
    torch.testing.assert_close(out, s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * w,
                               atol=ATOL, rtol=RTOL)


def test_silu_and_mul() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 20, generator=gen)
    g, u = x[:, :10], x[:, 10:]
    torch.testing.assert_close(torch_ops.silu_and_mul(x), g / (1 + torch.exp(-g)) * u, atol=ATOL, rtol=RTOL)


def test_cuda_ops_rejects_cpu_tensors() -> None:
    """The CUDA module's argument checks run before any device work (needs only cupy)."""
    pytest.importorskip("cupy", reason="cupy not installed: cuda_ops argument checks not run")
    try:
        from pdserve.runtime.kernels import cuda_ops  # noqa: PLC0415
    except ImportError as exc:
        pytest.skip(f"cuda_ops not importable: {exc}")
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ops.paged_decode_attention(torch.zeros(1, 2, 32), torch.zeros(1, 1, 2, 4, 1, 32), 0,
                                        torch.zeros(1, 1, dtype=torch.int64),
                                        torch.ones(1, dtype=torch.int64), 1.0)
