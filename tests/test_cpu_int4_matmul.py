"""4- and 8-bit weights times fp32 activations in C (pdserve.runtime.kernels.cpu_int4_matmul), the
8-bit head (pdserve.quant.q8_head) and the fp32 int4 engine built on them.

References: the float64 matmul of the dequantized weight (within the bound the inputs' int8
quantization allows, and no more), a torch emulation of the same quantization (to fp32 rounding),
gguf's own Q8_0 quantizer, and the dense fp32 engine on the same codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from pdserve.quant.int4_cpu import Int4Linear
from pdserve.quant.int4_codes import Int4Codes, quantize_rtn, weights_for
from pdserve.quant.q8_head import Q8Head
from pdserve.runtime.config import CacheConfig, ConfigError, EngineConfig
from pdserve.runtime.kernels import cpu_int4_matmul as kernel

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the CPU kernels")

# (rows, outputs, inputs): row tails of the 4- and 8-row tiles (AVX2, AVX-512), an odd output count (the 2-row tail), one group
SHAPES = [(1, 577, 576), (3, 64, 96), (5, 130, 64), (9, 7, 32), (14, 34, 64), (15, 66, 96), (32, 96, 576)]


def _random_int4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-4
    mins = torch.randn(n, k // 32, generator=gen) * 0.05
    return codes, scale, mins


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _dequantized(codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    n, k = codes.shape
    w = codes.double().view(n, k // 32, 32) * scale.double()[..., None]
    return (w if mins is None else w + mins.double()[..., None]).view(n, k)


def _emulated(x: torch.Tensor, w_codes: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The kernel's sums in torch: x quantized as the C side does (round half to even of x * (1 / d))."""
    m, k = x.shape
    groups = x.view(m, k // 32, 32)
    d = groups.abs().amax(-1) / 127  # [M, G]
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(groups * inv[..., None])  # [M, G, 32]
    n = w_codes.shape[0]
    dots = torch.einsum("mgk,ngk->mng", xq.double(), w_codes.double().view(n, k // 32, 32))  # exact integers
    y = (dots * (scale.double()[None] * d.double()[:, None])).sum(-1)
    if mins is not None:
        y += (xq.double().sum(-1) * d.double()) @ mins.double().t()  # the quantized inputs' sums
    return y


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_kernel_is_within_the_input_quantization_bound_of_the_dense_matmul(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * n)
    codes, scale, mins = _random_int4(n, k, gen)
    x = torch.randn(m, k, generator=gen)
    y = kernel.matmul(x, _nibbles(codes), scale, mins).double()
    want = x.double() @ _dequantized(codes, scale, mins).t()
    bound = kernel.error_bound(x, codes, scale, mins).double()
    assert ((y - want).abs() <= bound + 1e-5 * want.abs().max()).all()
    assert (y - want).abs().max() > 0  # the inputs really are quantized: the bound is not vacuous
    assert torch.allclose(y, _emulated(x, codes, scale, mins), rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[0] < 8], ids=str)
def test_bf16_int4_kernel_is_the_fp32_kernel_on_the_widened_inputs_rounded_once(shape):
    """bf16 rows in, bf16 out: exactly the fp32 kernel's sums (checked above against float64) on the
    inputs widened, plus the bias, rounded once to bf16."""
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n)
    codes, scale, mins = _random_int4(n, k, gen)
    x, bias = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    got = kernel.matmul_bf16(x, _nibbles(codes), scale, mins, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kernel.matmul(x.float(), _nibbles(codes), scale, mins, bias).bfloat16())
    assert kernel.matmul_bf16(x.float(), _nibbles(codes), scale, mins) is None  # fp32 rows: `matmul`'s


def test_bf16_int4_linear_runs_few_rows_on_the_kernel_and_more_on_torchs_or_amx():
    gen = torch.Generator().manual_seed(3)
    codes = quantize_rtn(torch.randn(96, 576, generator=gen) * 0.05).for_dtype(torch.bfloat16)
    linear = Int4Linear(codes)
    x = torch.randn(kernel.BF16_Q8_BELOW_ROWS, 576, generator=gen).bfloat16()
    few = x[:-1]
    q8 = linear.q8
    assert torch.equal(linear(few), kernel.matmul_bf16(few, q8.nibbles, q8.scale, q8.mins))
    want = few.double() @ linear.dequantized().double().t()
    bound = kernel.error_bound(few.float(), linear.codes_f32(), q8.scale, q8.mins).double()
    assert ((linear(few).double() - want).abs() <= bound + 2 ** -8 * want.abs() + 1e-5).all()
    if linear.amx is not None:  # a CPU with AMX-BF16: those rows on its kernel (tests/test_cpu_int4_amx.py)
        assert torch.equal(linear(x), kernel.matmul_amx(x, linear.amx, linear.scales_and_zeros, 96))
    else:
        assert torch.equal(linear(x), torch._weight_int4pack_mm_for_cpu(x, linear.packed, 32, linear.scales_and_zeros))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_kernel_matches_the_emulated_quantization_and_the_bound(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen) * 3
    y = kernel.matmul_int8(x, codes, scale).double()
    want = x.double() @ _dequantized(codes, scale, None).t()
    assert ((y - want).abs() <= kernel.error_bound(x, codes, scale).double() + 1e-5 * want.abs().max()).all()
    assert torch.allclose(y, _emulated(x, codes, scale, None), rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_zero_and_strided_inputs():
    gen = torch.Generator().manual_seed(3)
    codes, scale, mins = _random_int4(64, 64, gen)
    x = torch.randn(4, 128, generator=gen)[:, ::2]  # a strided view: copied, not misread
    x[1] = 0  # an all-zero row: scale 0, no division by it
    y = kernel.matmul(x, _nibbles(codes), scale, mins)
    assert torch.equal(y[1], torch.zeros(64))
    assert torch.allclose(y.double(), _emulated(x.contiguous(), codes, scale, mins), rtol=1e-5, atol=1e-4)


def test_threads_split_the_outputs_without_changing_a_bit():
    gen = torch.Generator().manual_seed(4)
    codes, scale, mins = _random_int4(1024, 128, gen)
    x = torch.randn(3, 128, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.matmul(x, _nibbles(codes), scale, mins)
        torch.set_num_threads(2)
        two = kernel.matmul(x, _nibbles(codes), scale, mins)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_q8_head_rederives_a_q8_0_tensor_exactly_and_multiplies_it():
    w = np.random.default_rng(0).standard_normal((300, 96)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q8_0)  # gguf's own quantizer: fp16 scales, codes in +-127
    dense = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    head = Q8Head.from_dense(dense)
    assert torch.equal(head.dequantize(), dense)  # the file's weights, not a re-quantization of them
    ids = torch.tensor([0, 7, 299, 7])
    assert torch.equal(head.embedding(ids), dense[ids])
    x = torch.randn(5, 96)
    want = x.double() @ dense.double().t()
    got = head(x).double()
    assert ((got - want).abs() <= kernel.error_bound(x, head.codes, head.scale).double() + 1e-5).all()


def test_fp32_int4_linear_runs_the_kernel_fused_equal_to_separate():
    gen = torch.Generator().manual_seed(5)
    q = quantize_rtn(torch.randn(96, 64, generator=gen)).for_dtype(torch.float32)
    k = quantize_rtn(torch.randn(32, 64, generator=gen)).for_dtype(torch.float32)
    bias = torch.randn(128, generator=gen)
    fused = Int4Linear.fused([q, k], bias)
    assert fused.packed is None and fused.mins is not None  # our packing only: no second copy of the codes
    for rows in (1, 6, fused.dense_from_rows + 1):  # the last: dequantized, then dense
        x = torch.randn(rows, 64, generator=gen)
        want = F.linear(x.double(), torch.cat([q.dequantize(), k.dequantize()]).double(), bias.double())
        got = fused(x)
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
        assert torch.equal(got[:, :96], Int4Linear(q, bias[:96])(x))


def test_fp32_int4_linear_with_an_input_permutation():
    gen = torch.Generator().manual_seed(6)
    base = quantize_rtn(torch.randn(32, 64, generator=gen))
    perm = torch.randperm(64, generator=gen)
    codes = Int4Codes(base.codes, base.scale, base.zero, torch.float32, 1, perm)
    x = torch.randn(3, 64, generator=gen)
    want = x.double() @ codes.dequantize().double().t()  # dequantize() puts the columns back
    assert (Int4Linear(codes)(x).double() - want).abs().max() <= 2e-2 * want.abs().max()


def test_int4_runs_in_float32_and_packed_still_needs_reduced_precision():
    assert EngineConfig(weight_format="int4", dtype="float32").weight_format == "int4"
    with pytest.raises(ConfigError, match="--weight-format packed runs with --dtype bfloat16 or float16"):
        EngineConfig(weight_format="packed", dtype="float32")


# ---- SmolLM2 in fp32: the file's Q4_1 projections on the kernel, its Q8_0 head as 8-bit codes ------


def test_int4_in_float32_takes_the_files_4bit_codes_and_8bit_head(smollm2):
    from pdserve.quant.q8_head import pack_head

    config = EngineConfig(dtype="float32", weight_format="int4")
    weights, fmt = weights_for(smollm2, config)
    assert fmt == "int4"
    assert all(isinstance(weights[n], Int4Codes) for n in smollm2.config.arch.projection_names(smollm2.config))
    arch = smollm2.config.arch
    head = pack_head(weights, smollm2, config, fmt)
    assert head[arch.global_name("embed")] is head[arch.global_name("lm_head")]  # tied: one copy of the codes
    assert torch.equal(head[arch.global_name("embed")].dequantize(), smollm2.weights[arch.global_name("embed")])
    assert pack_head(weights, smollm2, EngineConfig(dtype="float32", weight_format="dense"), "dense") is weights


def test_fp32_int4_model_follows_the_dense_model_on_the_same_codes(smollm2):
    """Both run the file's codes (the dense one dequantized to fp32): the kernel's only difference is
    the inputs' int8 quantization. Teacher-forced over a chat answer they agree almost everywhere: KL
    0.0032 and every argmax (Zen 4). With the inputs' exact sums beside their quantized codes (the
    kernels before stop 55, int4_common.h) it was 0.020 and 97%: this bound fails that arithmetic."""
    from pdserve.commands.quant_eval import kl_and_top1, sequence_logits
    from pdserve.quant.q8_head import pack_head
    from pdserve.runtime.model import LlamaModel

    ck = smollm2
    ids = ck.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. Water boils at 100 "
                              "degrees Celsius at sea level, and the largest planet in our solar system is")
    config = EngineConfig(cache=CacheConfig(num_blocks=64), dtype="float32", weight_format="int4")
    packed_weights = pack_head(weights_for(ck, config)[0], ck, config, "int4")
    assert isinstance(packed_weights[ck.config.arch.global_name("embed")], Q8Head)
    dense = sequence_logits(LlamaModel(ck.config, ck.weights), ids, kv_dtype="float32")
    packed = sequence_logits(LlamaModel(ck.config, packed_weights), ids, kv_dtype="float32")
    kl, top1 = kl_and_top1([dense], [packed])
    assert top1 >= 0.95 and kl < 0.008, (top1, kl)



def test_fp32_int4_token_keeps_its_logits_whatever_its_step_holds(smollm2):
    """Generated tokens run the kernel and prompt tokens the dense weight, whatever the step's mix: a
    decode step that shares its forward with another request's 300-token prompt (more rows than the
    dense-from-rows count) gives the decoding request the logits it gets alone, bit for bit."""
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.sampling_params import SamplingParams

    engine = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=64), dtype="float32",
                                                          weight_format="int4"))
    assert engine.weight_format == "int4"
    engine.keep_logits = True
    tok = smollm2.tokenizer
    first = tok.encode("Write a haiku about the sea.")
    second = tok.encode("Summarise: " + "the ships sail by the harbour wall at dawn. " * 30)
    assert len(second) > 300
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def first_row_logits(with_second: bool) -> torch.Tensor:
        engine.add_request("a", first, greedy)
        for _ in range(3):  # a's prompt, then two decodes
            engine.step()
        if with_second:
            engine.add_request("b", second, greedy)  # its prompt shares the next forward with a's decode
        engine.step()
        logits = engine.last_logits[0].clone()  # decode rows come first: a's
        while engine.has_unfinished():
            engine.step()
        return logits

    assert torch.equal(first_row_logits(True), first_row_logits(False))


def test_fp32_int4_prompt_rows_are_the_same_bits_whatever_the_row_and_thread_count(monkeypatch):
    """A prompt row's dense matmul gives the same bits alone, in a longer prompt, or beside other
    prompts, on one thread or two, and with a kept dense copy (a prefill worker's, in oneDNN's layout)
    as without: BLAS picks its GEMM kernel and split by the row count (MKL on AVX-512 differs below 16
    rows, and from about 58 rows on two threads at K = 1536), and the next layer's int8 inputs would
    turn that ulp into a flipped greedy token."""
    from pdserve.quant import int4_cpu
    from pdserve.quant.int4_cpu import RowKinds, token_kinds

    paths = [False, True] if int4_cpu._ONEDNN_LINEAR else [False]  # MKL chunks; oneDNN where torch has it
    gen = torch.Generator().manual_seed(8)
    codes = quantize_rtn(torch.randn(576, 1536, generator=gen)).for_dtype(torch.float32)
    plain, kept = Int4Linear(codes), Int4Linear(codes)
    kept.keep_dense_copy()
    x = torch.randn(130, 1536, generator=gen)
    threads = torch.get_num_threads()

    def prompt_rows(rows: torch.Tensor, n_threads: int, linear: Int4Linear = plain) -> torch.Tensor:
        torch.set_num_threads(n_threads)
        try:
            with token_kinds(RowKinds.of(torch.zeros(rows.shape[0], dtype=torch.bool))):
                return linear(rows)
        finally:
            torch.set_num_threads(threads)

    want = x[:5].double() @ plain.dequantized().double().t()
    for onednn in paths:
        monkeypatch.setattr(int4_cpu, "_ONEDNN_LINEAR", onednn)
        alone = prompt_rows(x[:5], 1)
        for m in (5, 16, 17, 64, 130):
            for n_threads in (1, 2):
                assert torch.equal(prompt_rows(x[:m], n_threads)[:5], alone), (onednn, m, n_threads)
                assert torch.equal(prompt_rows(x[:m], n_threads, kept)[:5], alone), (onednn, m, n_threads)
        assert (alone.double() - want).abs().max() <= 1e-4 * want.abs().max()
