"""The C row operations of a decoder layer (pdserve.runtime.kernels.cpu_layer_ops) against torch's
paths (torch_ops.*_torch, computed in float64 where rounding matters), their row independence, and
where they hand back to torch."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.kernels import cpu_attention, cpu_int4_matmul, cpu_layer_ops, torch_ops

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler: the kernels cannot be built")

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN) * scale


@pytest.mark.parametrize("d", [576, 64, 13])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_the_float64_norm_to_fp32_rounding(d, with_residual):
    wide = _randn(5, d + 7, scale=3.0)
    x = wide[:, :d]  # rows with a stride, as a view of a wider output
    residual = _randn(5, d) if with_residual else None
    weight = _randn(d)
    out, summed = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    s = x.double() + (residual.double() if with_residual else 0)
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)
    assert torch.equal(summed, x + residual) if with_residual else summed is x
    theirs = torch_ops.rms_norm_torch(s.float(), weight, 1e-5)  # torch's own fp32 norm: as close
    torch.testing.assert_close(out, theirs, rtol=2e-6, atol=1e-6)


def test_rope_equals_torch_rotate_half_on_views_of_the_fused_output():
    n, h, kvh, d = 6, 9, 3, 64
    cos, sin = torch_ops.rope_cos_sin(d, 4096, 10000.0)
    qkv = _randn(n, (h + 2 * kvh) * d, scale=2.0)
    q, k, _ = qkv.split((h * d, kvh * d, kvh * d), dim=-1)
    q, k = q.view(n, h, d), k.view(n, kvh, d)
    positions = torch.tensor([0, 1, 17, 300, 4095, 2048])
    got_q, got_k = torch_ops.apply_rope(q, k, positions, cos, sin)
    want_q, want_k = torch_ops.apply_rope_torch(q.double(), k.double(), positions, cos.double(), sin.double())
    torch.testing.assert_close(got_q.double(), want_q, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(got_k.double(), want_k, rtol=1e-6, atol=2e-6)
    assert got_q.is_contiguous() and torch.equal(qkv[:, :h * d].view(n, h, d), q)  # its input untouched


def test_rope_of_a_position_past_the_tables_raises_as_torch_does():
    cos, sin = torch_ops.rope_cos_sin(64, 128, 10000.0)
    q, k = _randn(2, 9, 64), _randn(2, 3, 64)
    assert cpu_layer_ops.rope(q, torch.tensor([3, 128]), cos, sin) is None
    with pytest.raises(IndexError):
        torch_ops.apply_rope(q, k, torch.tensor([3, 128]), cos, sin)


@pytest.mark.parametrize("inter", [1536, 13, 8])
def test_silu_and_mul_matches_torch_across_the_exponent_range(inter):
    gate_up = _randn(4, 2 * inter, scale=4.0)
    gate_up[0, :inter] = torch.linspace(-100.0, 100.0, inter)  # exp's clamps: silu -> 0 and -> gate
    got = torch_ops.silu_and_mul(gate_up)
    want = torch_ops.silu_and_mul_torch(gate_up.double())
    torch.testing.assert_close(got.double(), want, rtol=3e-6, atol=1e-6)


def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    """Each row is computed by itself: batched equals alone for every row operation, bit for bit."""
    x, residual, weight, gate_up = _randn(9, 576), _randn(9, 576), _randn(576), _randn(9, 3072, scale=3.0)
    cos, sin = torch_ops.rope_cos_sin(64, 512, 10000.0)
    q, positions = _randn(9, 9, 64), torch.arange(100, 109)
    batch_norm, _ = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    batch_rope = cpu_layer_ops.rope(q, positions, cos, sin)
    batch_act = cpu_layer_ops.silu_and_mul(gate_up)
    for r in range(9):
        assert torch.equal(cpu_layer_ops.add_rms_norm(x[r:r + 1], residual[r:r + 1], weight, 1e-5)[0][0], batch_norm[r])
        assert torch.equal(cpu_layer_ops.rope(q[r:r + 1], positions[r:r + 1], cos, sin)[0], batch_rope[r])
        assert torch.equal(cpu_layer_ops.silu_and_mul(gate_up[r:r + 1])[0], batch_act[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_torch_indexing(dtype):
    cache = torch.zeros(6, 3, 2, 16, 3, 64, dtype=dtype)
    want = cache.clone()
    qkv = _randn(5, 9 * 64 + 2 * 3 * 64).to(dtype)
    _, k, v = qkv.split((9 * 64, 3 * 64, 3 * 64), dim=-1)
    k, v = k.view(5, 3, 64), v.view(5, 3, 64)
    slots = torch.tensor([0, 17, 35, 95, 64])
    assert cpu_layer_ops.write_kv(cache, 1, k, v, slots)
    blocks, offsets = slots // 16, slots % 16
    want[blocks, 1, 0, offsets] = k
    want[blocks, 1, 1, offsets] = v
    assert torch.equal(cache, want)


def test_other_dtypes_and_layouts_hand_back_to_torch():
    x = _randn(2, 64)
    assert cpu_layer_ops.add_rms_norm(x.half(), None, _randn(64).half(), 1e-5) is None
    assert cpu_layer_ops.add_rms_norm(x.bfloat16(), None, _randn(64), 1e-5) is None  # mixed dtypes
    assert cpu_layer_ops.add_rms_norm(x.t().contiguous().t(), None, _randn(2), 1e-5) is None  # column-major rows
    assert cpu_layer_ops.silu_and_mul(_randn(2, 16).half()) is None
    cache = torch.zeros(2, 1, 2, 16, 1, 64)
    assert not cpu_layer_ops.write_kv(cache, 0, x.bfloat16().view(2, 1, 64), x.bfloat16().view(2, 1, 64),
                                      torch.tensor([0, 1]))  # a bf16 input into an fp32 cache: torch converts
    got = torch_ops.rms_norm(x.bfloat16(), _randn(64).bfloat16(), 1e-5)
    assert got.dtype == torch.bfloat16


def test_inputs_that_need_gradients_take_torchs_differentiable_path():
    """C has no backward: training through the layer (QAT) must still get gradients."""
    x, weight = _randn(3, 64).requires_grad_(), _randn(64).requires_grad_()
    gate_up = _randn(3, 32).requires_grad_()
    (torch_ops.rms_norm(x, weight, 1e-5).sum() + torch_ops.silu_and_mul(gate_up).sum()).backward()
    assert x.grad is not None and weight.grad is not None and gate_up.grad is not None
    with torch.no_grad():
        assert cpu_layer_ops.add_rms_norm(x, None, weight, 1e-5) is not None  # no graph wanted: C


def test_write_kv_skips_padding_slots_and_refuses_slots_past_the_cache():
    cache = torch.zeros(2, 1, 2, 16, 1, 64)
    rows = _randn(2, 1, 64)
    assert cpu_layer_ops.write_kv(cache, 0, rows, rows, torch.tensor([-1, 5]))
    assert torch.equal(cache[0, 0, 0, 5], rows[1]) and int((cache != 0).sum()) == 2 * 64  # only slot 5
    with pytest.raises(IndexError, match="past the cache"):
        cpu_layer_ops.write_kv(cache, 0, rows, rows, torch.tensor([3, 32]))
    assert int((cache != 0).sum()) == 2 * 64  # nothing written


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's bf16 ulp (b's spacing at its magnitude)."""
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(1e-30))))
    return (a.float() - b.float()).abs() / ulp


@pytest.mark.parametrize("d", [576, 64, 13])
@pytest.mark.parametrize("with_residual", [True, False])
def test_bf16_add_rms_norm_rounds_where_torch_does(d, with_residual):
    """bf16 rows: the sum rounded to bf16, the normalized row rounded to bf16, times the weight rounded
    to bf16 (torch_ops.rms_norm_torch): torch's bits, or one ulp off where fp32's 1 / rms differs in
    its last place; and within bf16 rounding of the float64 norm."""
    wide = _randn(7, d + 5, scale=3.0).bfloat16()
    x = wide[:, :d]
    residual = _randn(7, d).bfloat16() if with_residual else None
    weight = (_randn(d) + 1).bfloat16()
    out, summed = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == summed.dtype == torch.bfloat16
    s = x + residual if with_residual else x
    assert torch.equal(summed, s) if with_residual else summed is x
    theirs = torch_ops.rms_norm_torch(s, weight, 1e-5)
    assert _bf16_ulps(out, theirs).max() <= 1 and (out != theirs).float().mean() < 0.01
    exact = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    # Two roundings of half an ulp, the first scaled by the weight: at most 1.5 of the result's ulps.
    assert (_bf16_ulps(out, exact) <= 1.51).all()


def test_bf16_rope_is_torchs_bit_for_bit():
    n, h, kvh, d = 6, 9, 3, 64
    cos, sin = torch_ops.rope_cos_sin(d, 4096, 10000.0)
    qkv = _randn(n, (h + 2 * kvh) * d, scale=2.0).bfloat16()
    q, k, _ = qkv.split((h * d, kvh * d, kvh * d), dim=-1)
    q, k = q.view(n, h, d), k.view(n, kvh, d)
    positions = torch.tensor([0, 1, 17, 300, 4095, 2048])
    got_q = cpu_layer_ops.rope(q, positions, cos, sin)
    got_k = cpu_layer_ops.rope(k, positions, cos, sin)
    want_q, want_k = torch_ops.apply_rope_torch(q, k, positions, cos, sin)
    assert got_q.dtype == torch.bfloat16 and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_bf16_rows_get_the_same_bits_alone_and_in_a_batch():
    x, residual, weight = _randn(9, 576).bfloat16(), _randn(9, 576).bfloat16(), _randn(576).bfloat16()
    cos, sin = torch_ops.rope_cos_sin(64, 256, 10000.0)
    q, positions = _randn(9, 9, 64).bfloat16(), torch.arange(9) * 7
    together = cpu_layer_ops.add_rms_norm(x, residual, weight, 1e-5)[0]
    alone = torch.cat([cpu_layer_ops.add_rms_norm(x[i:i + 1], residual[i:i + 1], weight, 1e-5)[0] for i in range(9)])
    assert torch.equal(together, alone)
    rotated = cpu_layer_ops.rope(q, positions, cos, sin)
    assert torch.equal(rotated, torch.cat([cpu_layer_ops.rope(q[i:i + 1], positions[i:i + 1], cos, sin)
                                           for i in range(9)]))
    # bf16 SiLU of 5 rows on: C's on a CPU with AVX512-BF16 (faster there at any size), else torch's
    for rows in (5, cpu_int4_matmul.AMX_BELOW_ROWS, 400):
        assert (cpu_layer_ops.silu_and_mul(_randn(rows, 64).bfloat16()) is None) != cpu_int4_matmul.bf16_available()


def test_bf16_silu_of_few_rows_is_torchs_within_one_ulp_and_alone_equals_batched():
    gate_up = _randn(4, 2 * 1536, scale=4.0).bfloat16()
    got = cpu_layer_ops.silu_and_mul(gate_up)
    want = torch_ops.silu_and_mul_torch(gate_up)
    assert got.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got != want).float().mean() < 0.01  # rounded where torch rounds: one ulp apart, rarely
    assert torch.equal(torch.cat([cpu_layer_ops.silu_and_mul(gate_up[i:i + 1]) for i in range(4)]), got)


@pytest.fixture(scope="module")
def baseline_library(tmp_path_factory):
    """The library built for the architecture's baseline (x86-64-v3: 8-lane AVX2), whatever this CPU has."""
    import ctypes

    lib = ctypes.CDLL(str(cpu_attention.build_portable(tmp_path_factory.mktemp("portable") / "portable.so")))
    for name, argtypes in cpu_attention._LAYER_OPS_ARGS.items():
        getattr(lib, name).argtypes = argtypes
    return lib


def _bf16_row_ops(lib, x, residual, weight, gate_up, q, positions, cos, sin, scores, lens):
    """Each bf16 row operation and the softmax through `lib` (ctypes, cpu_attention._LAYER_OPS_ARGS): their outputs."""
    n, d = x.shape
    out, summed = torch.empty_like(x), torch.empty_like(x)
    lib.add_rms_norm_bf16(x.data_ptr(), d, residual.data_ptr(), weight.data_ptr(), n, d, 1e-5, out.data_ptr(),
                          summed.data_ptr())
    silu = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.bfloat16)
    lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.shape[1], gate_up.shape[0], silu.shape[1], silu.data_ptr())
    rotated = torch.empty_like(q)
    assert lib.rope_bf16(q.data_ptr(), q.shape[1] * q.shape[2], q.shape[0], q.shape[1], q.shape[2],
                         positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], rotated.data_ptr()) == 0
    probs = scores.clone()
    lib.softmax_rows_f32(probs.data_ptr(), probs.shape[0], probs.shape[1], 1, lens.data_ptr())
    return out, summed, silu, rotated, probs


@pytest.mark.parametrize("d,head_dim", [(576, 64), (40, 48), (13, 128)])
def test_this_cpus_vector_width_gives_the_baseline_builds_bits(baseline_library, d, head_dim):
    """16-lane AVX-512 row operations (where this CPU has them) compute each element as the 8-lane
    AVX2 build does, and the softmax sums in the same order: the same bits, row tails included."""
    x, residual, weight = (_randn(5, d, scale=3.0).bfloat16(), _randn(5, d).bfloat16(),
                           (_randn(d) + 1).bfloat16())
    gate_up = _randn(3, 2 * (d + 3), scale=4.0).bfloat16()
    cos, sin = torch_ops.rope_cos_sin(head_dim, 512, 10000.0)
    q, positions = _randn(4, 3, head_dim, scale=2.0).bfloat16(), torch.tensor([0, 5, 300, 511])
    lens = torch.tensor([1, 7, 8, 15, 16, 17, 31, *range(32, 300, 5)], dtype=torch.int64)
    scores = _randn(len(lens), 300)
    args = (x, residual, weight, gate_up, q, positions, cos, sin, scores, lens)
    for mine, baseline in zip(_bf16_row_ops(cpu_attention.library(), *args), _bf16_row_ops(baseline_library, *args)):
        assert torch.equal(mine, baseline)


def _argmax_cases(cols: int) -> torch.Tensor:
    """Rows whose argmax is torch's business to define: random, a tie across vector blocks, NaNs before
    and after the largest value and in the tail, all -inf, an +inf. A [rows, cols] view of a wider
    tensor (rows `cols + 7` apart)."""
    nan, inf = float("nan"), float("inf")
    wide = _randn(9, cols + 7, scale=5.0)
    x = wide[:, :cols]
    last = cols - 1
    x[1, last // 3] = x[1, last] = 50.0  # a tie: the first wins
    x[2, last // 2], x[2, last] = 60.0, nan  # a NaN after the largest value: the NaN
    x[3, 0 if cols == 1 else 1], x[3, last] = nan, nan  # the first NaN
    x[4] = -inf
    x[5, last // 4] = inf
    x[6, last] = 70.0  # the largest in the tail
    x[7, 0] = 80.0
    x[8, last // 5], x[8, last // 2] = nan, 90.0
    return x


@pytest.mark.parametrize("cols", [49152, 600, 33, 16, 5, 1])
def test_argmax_rows_is_torchs_max_indices(baseline_library, cols):
    """Greedy sampling's C argmax picks what torch's max(dim=-1).indices picks (the first maximal value,
    the first NaN of a row with one), in this CPU's build and in the baseline AVX2 build."""
    x = _argmax_cases(cols)
    want = x.max(dim=-1).indices.tolist()
    assert cpu_layer_ops.argmax_rows(x) == want
    out = torch.empty(x.shape[0], dtype=torch.int64)
    baseline_library.argmax_rows_f32(x.data_ptr(), x.shape[0], cols, x.stride(0), out.data_ptr())
    assert out.tolist() == want
    assert cpu_layer_ops.argmax_rows(x.t().contiguous().t()) is None  # column-major rows: torch's
    assert cpu_layer_ops.argmax_rows(x.half()) is None
