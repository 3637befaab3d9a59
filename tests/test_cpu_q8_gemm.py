"""The VNNI GEMM (kernels/cpu/int4_q8_gemm.c): bf16 rows of generated tokens, however few, of a 4-bit
linear, on a CPU with AVX512-VNNI and no AMX, take llama.cpp's Q4_1 x Q8_1 sums register-tiled.

References: torch's emulation of the same int8 quantization of the inputs with exact integer dots
(float64, test_cpu_int4_matmul's), the float64 matmul of the dequantized weight (within the bound
the inputs' quantization allows), the few-row C kernel (`matmul_bf16`, the same sums in another
order) and, for a SmolLM2 step, the dense copy's exact products. Where the kernel is not built (no
AVX512-VNNI) or AMX's kernel takes these calls, each test asserts that it steps aside instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_cpu_int4_matmul import _emulated, _nibbles, _random_int4

from pdserve.quant import int4_cpu
from pdserve.quant.int4_cpu import Int4Linear
from pdserve.quant.int4_codes import quantize_rtn
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_int4_matmul as kernel
from pdserve.runtime.kernels.cpu_int4_matmul import BF16_Q8_BELOW_ROWS
from pdserve.runtime.sampling_params import SamplingParams

GEMM = kernel.q8_gemm_available()
# (rows, outputs, inputs): the 4-row tile's tails, one panel (16 outputs), an odd panel count, one group,
# SmolLM2's fused q/k/v and down projections
SHAPES = [(1, 16, 32), (3, 48, 64), (5, 80, 96), (17, 32, 576), (32, 960, 576), (63, 576, 1536)]


def _gemm(x, codes, scale, mins, bias=None):
    return kernel.matmul_q8_gemm(x, kernel.q8_gemm_panels(_nibbles(codes), scale, mins), bias)


def _quantized_in_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_1 of bf16 rows in fp32 torch: d = max |x| / 127 a group of 32, codes x * (1 / d)
    rounded half to even, xsum = d times the codes' sum."""
    m, k = x.shape
    groups = x.float().view(m, k // 32, 32)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(groups * inv[..., None])
    return codes.to(torch.int8).view(m, k), d, codes.sum(-1) * d


def test_the_inputs_quantization_is_torchs_bit_for_bit():
    """The vectorized quantization every GEMM call starts with: the same codes, scales and sums as the
    fp32 arithmetic it replaced (torch's here), ties rounded half to even, zero groups, extreme values."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(7, 576, generator=gen) * torch.logspace(-6, 6, 7)[:, None]).bfloat16()
    x[1, 32:64] = 0  # a zero group: d 0, codes 0
    x[2, :32] = torch.tensor([127.0, -2.5, 3.5, -0.5, 0.5, 1.5] + [64.5] * 26)  # d = 1: ties at .5
    x[3, 64:96] = torch.tensor([3.0e38, -1.0e-38] * 16)
    for wrong in (x.float(), x[:, :40]):  # fp32 rows, K not a multiple of 32: refused, not misread
        with pytest.raises(ValueError, match="multiple of 32"):
            kernel.q8_gemm_inputs(wrong)
    if not GEMM:
        assert kernel.q8_gemm_inputs(x) is None
        return
    xq, xd, xsum = kernel.q8_gemm_inputs(x)
    want_q, want_d, want_sum = _quantized_in_torch(x)
    assert torch.equal(xq, want_q)
    assert torch.equal(xd, want_d) and torch.equal(xsum, want_sum)
    assert xq[2, :6].tolist() == [127, -2, 4, 0, 0, 2]


def test_the_panels_hold_each_code_and_scale_where_the_kernel_reads_it():
    gen = torch.Generator().manual_seed(1)
    codes, scale, mins = _random_int4(48, 96, gen)
    w = kernel.q8_gemm_panels(_nibbles(codes), scale, mins)
    assert w.codes.shape == (3, 12, 16, 4) and w.scale.shape == w.mins.shape == (3, 3, 16)
    for n, k in [(0, 0), (17, 5), (47, 95), (31, 64), (2, 3)]:
        byte = int(w.codes[n // 16, k // 8, n % 16, k % 4])
        assert (byte >> 4 if k % 8 >= 4 else byte & 0x0F) == codes[n, k]
        assert w.scale[n // 16, k // 32, n % 16] == scale[n, k // 32]
        assert w.mins[n // 16, k // 32, n % 16] == mins[n, k // 32]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_it_computes_the_quantized_sums_and_stays_within_their_bound(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * n + k)
    codes, scale, mins = _random_int4(n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = _gemm(x, codes, scale, mins, bias)
    if not GEMM:
        assert y is None
        return
    emulated = _emulated(x.float(), codes, scale, mins) + bias.double()
    # One rounding to bf16 of an fp32 sum: within a bf16 ulp of the largest output.
    ulp = 2 ** -7 * emulated.abs().max()
    assert (y.double() - emulated).abs().max() <= ulp
    w = codes.double().view(n, k // 32, 32) * scale.double()[..., None] + mins.double()[..., None]
    exact = x.double() @ w.view(n, k).t() + bias.double()
    bound = kernel.error_bound(x.float(), codes, scale, mins).double()
    assert ((y.double() - exact).abs() <= bound + ulp).all()


@pytest.mark.parametrize("shape", SHAPES[2:], ids=str)
def test_it_equals_the_few_row_kernel_but_for_the_order_of_its_sums(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(k)
    codes, scale, mins = _random_int4(n, k, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = _gemm(x, codes, scale, mins)
    if not GEMM:
        assert y is None
        return
    few_rows = kernel.matmul_bf16(x, _nibbles(codes), scale, mins)
    assert (y.float() - few_rows.float()).abs().max() <= 2 ** -7 * few_rows.float().abs().max()
    assert (y == few_rows).float().mean() > 0.99  # mostly the same bits


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_depend_on_neither_the_other_rows_nor_the_threads(threads):
    gen = torch.Generator().manual_seed(7)
    codes, scale, mins = _random_int4(3072, 576, gen)
    x = torch.randn(32, 576, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = _gemm(x, codes, scale, mins)
        alone = [_gemm(x[i:i + 1], codes, scale, mins) for i in (0, 13, 31)]
        strided = _gemm(x[5:30:3], codes, scale, mins)  # rows of a view with a row stride
    finally:
        torch.set_num_threads(before)
    if not GEMM:
        assert batch is None
        return
    for i, row in zip((0, 13, 31), alone):
        assert torch.equal(row, batch[i:i + 1])
    assert torch.equal(strided, batch[5:30:3])


def _linear(n: int, k: int, seed: int) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    return Int4Linear(quantize_rtn(torch.randn(n, k, generator=gen)), torch.randn(n, generator=gen))


def _generated(rows: int, every: int = 1) -> torch.Tensor:
    """[rows] bool: every `every`-th row a generated token's, the rest prompt tokens'."""
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[::every] = True
    return mask


def test_a_bf16_int4_linear_runs_generated_rows_on_it_and_other_rows_dense(monkeypatch):
    """With the dense copy, in a forward, generated tokens' rows take the GEMM however few (one row as
    eighty); prompt rows, and rows of no told kind (outside a forward), the copy;
    a mixed step splits its rows, each kind's bits whatever the other's rows. Without the copy nothing
    changes (torch's packing kept)."""
    lin = _linear(96, 64, seed=8)
    gen = torch.Generator().manual_seed(9)
    assert lin.q8_gemm is None and lin.packed is not None or lin.amx is not None  # no copy: as before
    lin.keep_dense_copy()  # a worker's: the GEMM with it
    if not GEMM or kernel.amx_available():
        assert lin.q8_gemm is None  # AMX's kernel (or torch's) keeps these calls
        return
    assert lin.q8_gemm is not None and lin.packed is None  # torch's packing is not kept beside it
    q8 = lin.q8
    few_row_calls = []
    few_row_kernel = kernel.matmul_bf16
    monkeypatch.setattr(kernel, "matmul_bf16", lambda *a: few_row_calls.append(a) or few_row_kernel(*a))
    for rows in (1, BF16_Q8_BELOW_ROWS - 1, BF16_Q8_BELOW_ROWS, 17, 80):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        with int4_cpu.token_kinds(int4_cpu.RowKinds.of(_generated(rows))):
            assert torch.equal(lin(x), kernel.matmul_q8_gemm(x, lin.q8_gemm, q8.bias))
        assert not few_row_calls, rows  # one row as many: the GEMM, not the few-row kernel
        if rows >= BF16_Q8_BELOW_ROWS:  # no kind told: by the count (the copy from 5 rows)
            assert torch.equal(lin(x), F.linear(x, lin.dequantized(), lin.bias))
    x = torch.randn(40, 64, generator=gen).bfloat16()
    generated = _generated(40, every=3)  # 14 generated rows among 26 prompt rows
    with int4_cpu.token_kinds(int4_cpu.RowKinds.of(generated)):
        y = lin(x)
    assert torch.equal(y[generated], kernel.matmul_q8_gemm(x[generated], lin.q8_gemm, q8.bias))
    assert torch.equal(y[~generated], F.linear(x[~generated], lin.dequantized(), lin.bias))


def _decode_logits(checkpoint, prompts: list[list[int]], gemm: bool = True) -> torch.Tensor:
    """[S, vocab]: the logits of one decode step of every prompt (a bf16 SmolLM2 engine with the dense
    copy; without `gemm` its projections forget the GEMM, and such steps take the copy as before it)."""
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(
        cache=CacheConfig(num_blocks=64, dtype="bfloat16"), scheduler=SchedulerConfig(max_num_seqs=len(prompts)),
        dtype="bfloat16", weight_format="auto", dense_copy=True))
    for layer in engine.runner.model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for part in getattr(linear, "parts", [linear]):
                if isinstance(part, Int4Linear) and not gemm:
                    part.q8_gemm = None
    engine.keep_logits = True
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    engine.step()  # the prompts (dense copy)
    engine.step()  # one decode step of all of them
    return engine.last_logits.clone()


def test_a_smollm2_decode_step_on_it_follows_the_dense_copys(smollm2_bf16):
    """16 sequences' decode step on the GEMM (int8 inputs) against the same step on the dense copy (bf16
    inputs, the exact products): logits within the inputs' quantization noise, the same greedy token
    wherever the top two are not near-tied."""
    tok = smollm2_bf16.tokenizer
    prompts = [tok.encode(f"Question {i}: what is {i} plus {i + 1}? Answer:") for i in range(16)]
    on_gemm = _decode_logits(smollm2_bf16, prompts)
    dense = _decode_logits(smollm2_bf16, prompts, gemm=False)  # 16 rows: past the copy's 8-row threshold
    if not GEMM or kernel.amx_available():
        assert torch.equal(on_gemm, dense)  # nothing ran it
        return
    diff = (on_gemm - dense).abs()
    assert 0 < diff.mean() < 0.5 and diff.max() < 3, (diff.mean(), diff.max())
    top2 = dense.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1.0
    assert torch.equal(on_gemm.argmax(-1)[clear], dense.argmax(-1)[clear]) and clear.sum() >= 8


@pytest.mark.parametrize("rows", [1, 3, 5, 37])
def test_8bit_codes_compute_the_quantized_sums_and_each_rows_bits_are_its_own(rows):
    """The head's 8-bit codes (`q8_head_panels`, stored + 128): the quantized sums of the
    codes themselves to fp32 rounding; a row alone, or on two threads, gives the same bits as in the call."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 192
    codes = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weights = kernel.q8_head_panels(codes, scale)
    y = kernel.matmul_q8_head(x, weights)
    if not GEMM:
        assert y is None
        return
    emulated = _emulated(x.float(), codes, scale, None)
    assert y.dtype == torch.float32 and (y.double() - emulated).abs().max() <= 1e-5 * emulated.abs().max()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernel.matmul_q8_head(x[-1:], weights), y[-1:])
        assert torch.equal(kernel.matmul_q8_head(x, weights), y)
    finally:
        torch.set_num_threads(before)
