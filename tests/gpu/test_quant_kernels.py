"""W8A16 / W4A16 kernel and the scaled (INT8 / FP8) KV cache on a GPU, against torch references.

quant_matmul is compared with dequantize-then-matmul in fp32 on the same inputs (the 16-bit
activations upcast, scales as the kernel reads them), so the tolerance is the kernel's own error:
fp32 accumulation in another order plus one rounding of the output (16-bit outputs of magnitude
up to ~4: one ulp is 4e-3 in fp16, 3e-2 in bf16). Shapes cover K not a multiple of the word
(172, the stories260K FFN), act-order g_idx, one group per channel (-1), split-K (large K) and
1..8 rows; more rows go to torch's GEMM and must agree as well.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_gpu

require_gpu()

from pdserve.quant.linear import QuantLinear  # noqa: E402
from pdserve.quant.packing import pack_rows  # noqa: E402
from pdserve.runtime.kernels import cuda_ops, cuda_quant, kv_quant, torch_ops  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


def _linear(bits: int, k: int, o: int, group: int, act_order: bool, seed: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    g = k if group == -1 else group
    groups = -(-k // g)
    codes = torch.randint(0, maxq + 1, (k, o), generator=gen)
    zeros = torch.randint(1, maxq + 1, (groups, o), generator=gen)
    scales = (torch.rand(groups, o, generator=gen) * 0.01 + 1e-4).half()
    g_idx = torch.arange(k) // g
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantLinear(pack_rows(codes, bits).to(DEV), zeros.to(DEV), scales.to(DEV),
                       g_idx.to(torch.int32).to(DEV), bits, k)


CASES = [  # bits, K, O, group, act-order
    (4, 172, 64, 32, False), (4, 64, 172, 32, False), (4, 4096, 4096, 128, False), (4, 4096, 1024, 128, True),
    (4, 1000, 300, 64, False), (8, 172, 64, -1, False), (8, 4096, 4096, -1, False), (8, 11008, 4096, -1, False),
    (8, 512, 96, 128, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("bits", "k", "o", "group", "act"), CASES)
def test_quant_matmul_matches_dequantized_matmul(bits, k, o, group, act, rows, dtype) -> None:
    ql = _linear(bits, k, o, group, act, seed=k * 31 + o)
    x = torch.randn(rows, k, generator=torch.Generator(device=DEV).manual_seed(rows), device=DEV).to(dtype)
    got = cuda_quant.quant_matmul(x, ql.qweight, ql.scales.float(), ql.zeros.float(), ql.g_idx.int(), bits)
    want = x.float() @ ql.weight_t(torch.float32)
    assert got.dtype == dtype and got.shape == (rows, o)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol * want.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_quant_linear_dispatch_on_cuda(rows: int) -> None:
    """QuantLinear: the kernel for up to 8 rows, torch's GEMM beyond; both equal the reference."""
    ql = _linear(4, 1024, 512, 128, False, seed=5)
    ql.bias = torch.randn(512, device=DEV).half()
    x = torch.randn(rows, 1024, device=DEV).half()
    want = x.float() @ ql.weight_t(torch.float32) + ql.bias.float()
    got = ql(x)
    torch.testing.assert_close(got.float(), want, atol=5e-3 * want.abs().max().item(), rtol=5e-3)


def test_quant_matmul_rejects_bad_arguments() -> None:
    ql = _linear(8, 64, 32, -1, False, seed=1)
    args = (ql.qweight, ql.scales.float(), ql.zeros.float(), ql.g_idx.int(), 8)
    with pytest.raises(ValueError, match="1..8 rows"):
        cuda_quant.quant_matmul(torch.randn(9, 64, device=DEV), *args)
    with pytest.raises(ValueError, match="scales must be torch.float32"):
        cuda_quant.quant_matmul(torch.randn(1, 64, device=DEV), ql.qweight, ql.scales.half(), *args[2:])
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_quant.quant_matmul(torch.randn(1, 64), *args)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_scaled_kv_cache_on_cuda_matches_cpu(kv_dtype: torch.dtype) -> None:
    """Writes and decode/prefill attention over an INT8 / FP8 cache through cuda_ops: the cache holds
    what the CPU path writes (to a code step), and attention equals torch's over the same cache."""
    gen = torch.Generator().manual_seed(3)
    nb, layers, bs, kvh, d, h = 8, 2, 16, 2, 64, 8
    caches = {dev: torch.zeros(nb, layers, 2, bs + 1, kvh, d, dtype=kv_dtype, device=dev) for dev in ("cpu", DEV)}
    k, v = torch.randn(40, kvh, d, generator=gen) * 3, torch.randn(40, kvh, d, generator=gen)
    slots = torch.cat([torch.arange(16, 46), torch.arange(80, 90)])  # blocks 1, 2 (partial), 5
    for start, end in ((0, 30), (30, 35), (35, 40)):  # a prefill, then token-sized writes
        for dev, cache in caches.items():
            mod = cuda_ops if dev == DEV else torch_ops
            mod.write_kv(cache, 1, k[start:end].to(dev), v[start:end].to(dev), slots[start:end].to(dev))
    for dev in ("cpu", DEV):
        assert kv_quant.scales_view(caches[dev]).isfinite().all()
    got_cache, want_cache = caches[DEV].cpu(), caches["cpu"]
    step = kv_quant.scales_view(want_cache)[:, 1].amax().item()
    torch.testing.assert_close(kv_quant.dequantize_slabs(got_cache[:, 1]), kv_quant.dequantize_slabs(want_cache[:, 1]),
                               atol=step * (1.01 if kv_dtype == torch.int8 else 32), rtol=0)
    q = torch.randn(2, h, d, generator=gen)
    tables = torch.tensor([[1, 2], [5, 0]])
    lens = torch.tensor([30, 10])
    want = torch_ops.paged_decode_attention(q, got_cache, 1, tables, lens, d ** -0.5)
    got = cuda_ops.paged_decode_attention(q.to(DEV), caches[DEV], 1, tables.to(DEV), lens.to(DEV), d ** -0.5)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    want = torch_ops.prefill_attention(q[:1].expand(5, h, d).contiguous(), got_cache, 1, tables[0], 30, 0.1)
    got = cuda_ops.prefill_attention(q[:1].expand(5, h, d).contiguous().to(DEV), caches[DEV], 1, tables[0].to(DEV),
                                     30, 0.1)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(("batch", "max_ctx", "block_size", "head_dim", "heads", "kv_heads"), [
    (1, 2048, 16, 128, 32, 8), (8, 300, 16, 64, 16, 4), (3, 17, 8, 128, 8, 8), (32, 1000, 16, 128, 64, 8),
])
def test_paged_decode_kernel_reads_scaled_cache(batch, max_ctx, block_size, head_dim, heads, kv_heads,
                                                kv_dtype, dtype) -> None:
    """The decode kernel's int8 / fp8 variants (codes widened and scaled per block and head as they
    load) against torch's gather-dequantize-SDPA in fp32 over the same cache."""
    gen = torch.Generator(device=DEV).manual_seed(batch * 31 + max_ctx)
    need = [-(-max_ctx // block_size)] * batch
    nb = sum(need) + 2
    shape = (nb, 2, 2, block_size + 1, kv_heads, head_dim)
    values = torch.randn(shape, generator=gen, device=DEV) * 40
    cache = (values.round().clamp(-127, 127) if kv_dtype == torch.int8 else values.clamp(-448, 448)).to(kv_dtype)
    kv_quant.scales_view(cache)[:] = torch.rand(nb, 2, 2, kv_heads, generator=gen, device=DEV) * 0.04 + 0.01
    perm = torch.randperm(nb, generator=gen, device=DEV)
    tables = perm[:batch * need[0]].view(batch, need[0]).contiguous()
    lens = torch.randint(1, max_ctx + 1, (batch,), generator=gen, device=DEV)
    lens[0] = max_ctx
    q = torch.randn(batch, heads, head_dim, generator=gen, device=DEV).to(dtype)
    got = cuda_ops.paged_decode_attention(q, cache, 1, tables, lens, head_dim ** -0.5)
    want = torch_ops.paged_decode_attention(q.float(), cache, 1, tables, lens, head_dim ** -0.5)
    atol, rtol = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
