"""bf16 compute with packed weights on the CPU: the 8-bit head's bf16 kernel (kernels/cpu/bf16_matmul.c,
pdserve.quant.q8_head) against the dense bf16 products, and the kept dense copy that decode steps of
many sequences take (Int4Linear.keep_dense_copy) against the packed kernel.

The kernel tests need a CPU with AVX512-BF16 (they skip elsewhere, where the head runs its dense
weight: the engine tests still run there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.quant.int4_cpu import DENSE_COPY_FROM_ROWS, DENSE_PACKED_FROM_ROWS, Int4Linear
from pdserve.quant.onednn_linear import onednn_packed
from pdserve.quant.q8_head import BF16_KERNEL_BELOW_ROWS, Q8Head
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_int4_matmul as kernel
from pdserve.runtime.sampling_params import SamplingParams

needs_bf16_kernel = pytest.mark.skipif(not kernel.bf16_available(), reason="no AVX512-BF16 build of the CPU kernels")


def _head(v: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [V, K] int8, scale [V, K/32] fp32, the weight bf16(codes * scale) [V, K])."""
    codes = torch.randint(-127, 128, (v, k), generator=gen).to(torch.int8)
    scale = torch.rand((v, k // 32), generator=gen) * 1e-3
    w = (codes.float().view(v, k // 32, 32) * scale[..., None]).view(v, k).to(torch.bfloat16)
    return codes, scale, w


@needs_bf16_kernel
@pytest.mark.parametrize("rows,v,k", [(1, 301, 576), (3, 64, 32), (8, 130, 96), (13, 99, 576)], ids=str)
def test_int8_bf16_kernel_sums_the_dense_bf16_products(rows, v, k):
    gen = torch.Generator().manual_seed(rows * 1000 + v)
    codes, scale, w = _head(v, k, gen)
    x = torch.randn((rows, k), generator=gen).to(torch.bfloat16)
    y = kernel.matmul_int8_bf16(x, codes, scale)
    exact = x.double() @ w.double().t()  # the products of bf16 values are exact in fp32: only sums round
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2.0 ** -24
    assert y.dtype == torch.float32 and y.shape == (rows, v)
    assert ((y.double() - exact).abs() <= bound).all()
    assert ((F.linear(x.float(), w.float()).double() - exact).abs() <= bound).all()  # the bound holds fp32's too


@needs_bf16_kernel
def test_int8_bf16_kernel_gives_a_row_the_same_bits_alone_batched_and_on_two_threads():
    gen = torch.Generator().manual_seed(7)
    codes, scale, _ = _head(2048, 576, gen)
    x = torch.randn((11, 576), generator=gen).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = kernel.matmul_int8_bf16(x, codes, scale)
        alone = torch.cat([kernel.matmul_int8_bf16(x[i:i + 1].clone(), codes, scale) for i in range(11)])
        torch.set_num_threads(2)
        split = kernel.matmul_int8_bf16(x, codes, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, split)
    strided = torch.randn((3, 1000), generator=gen).to(torch.bfloat16)[:, 100:676]  # rows not contiguous
    assert torch.equal(kernel.matmul_int8_bf16(strided, codes, scale),
                       kernel.matmul_int8_bf16(strided.contiguous(), codes, scale))


def test_int8_bf16_kernel_steps_aside_where_it_does_not_apply():
    codes, scale, _ = _head(64, 64, torch.Generator().manual_seed(1))
    assert kernel.matmul_int8_bf16(torch.randn(2, 64), codes, scale) is None  # fp32 inputs: not this kernel
    odd = torch.randint(-127, 128, (64, 48)).to(torch.int8)
    assert kernel.matmul_int8_bf16(torch.randn(2, 48).to(torch.bfloat16), odd, scale[:, :1]) is None  # K % 32


def _bf16_engine(checkpoint, dense_copy: bool, seqs: int = 16) -> Engine:
    return Engine.from_checkpoint(checkpoint, EngineConfig(
        cache=CacheConfig(num_blocks=64, dtype="bfloat16"), scheduler=SchedulerConfig(max_num_seqs=seqs),
        dtype="bfloat16", weight_format="auto", dense_copy=dense_copy))


@needs_bf16_kernel  # the head is kept as codes only where their bf16 kernel runs (pack_head)
def test_bf16_engine_keeps_the_files_q8_0_head_beside_its_dense_weight(smollm2_bf16, monkeypatch):
    """The head's codes are the file's: dequantized and rounded to bf16 they are the loaded weight,
    bit for bit, so the kernel and the dense matmul multiply the same weights; the dense weight is
    kept in oneDNN's layout (where torch has oneDNN), and the embedding's rows are the loaded ones.
    (Where the VNNI GEMM takes the head instead, below, its paths are checked here without it.)"""
    monkeypatch.setattr(Q8Head, "with_gemm", lambda self: self)
    engine = _bf16_engine(smollm2_bf16, dense_copy=False)
    head = engine.runner.model.lm_head
    assert isinstance(head, Q8Head) and head.bf16_weight is not None and head is engine.runner.model.embed
    embed = smollm2_bf16.weights[smollm2_bf16.config.arch.global_name("embed")]
    assert torch.equal(head.dequantize().to(torch.bfloat16), embed)
    assert (head.packed is not None) == (onednn_packed(embed[:32]) is not None)
    assert head.dense is (None if head.packed is not None else embed)  # one bf16 copy, not two
    assert torch.equal(head.embedding(torch.arange(embed.shape[0])), embed)  # every row's bits
    gen = torch.Generator().manual_seed(3)
    for rows in (BF16_KERNEL_BELOW_ROWS, 32, 200):  # the dense weight's rows: F.linear's bits, packed or not
        x = torch.randn((rows, embed.shape[1]), generator=gen).to(torch.bfloat16)
        assert torch.equal(head(x), F.linear(x, embed).float())
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn((BF16_KERNEL_BELOW_ROWS - 1, embed.shape[1]), generator=gen).to(torch.bfloat16)
    logits = head(hidden)  # the kernel's, rounded to bf16 as the dense matmul's output
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.bfloat16().float())
    dense = F.linear(hidden, embed).float()
    # Both round fp32 sums of the same products to bf16: apart by the two sums' difference (their
    # orders differ: at most 2 K 2^-24 sum |x w|, which near a cancelling zero may exceed the result's
    # own ulp) plus half an ulp of each rounding; and mostly the same.
    sums = (hidden.double().abs() @ embed.double().abs().t()) * 2 * embed.shape[1] * 2.0 ** -24
    ulp = 2.0 ** (torch.floor(torch.log2(torch.maximum(logits.abs(), dense.abs()).clamp_min(1e-30))) - 7)
    assert ((logits - dense).abs() <= sums.float() + ulp).all() and (logits != dense).float().mean() < 0.02


@needs_bf16_kernel
def test_on_a_vnni_cpu_without_amx_every_bf16_head_call_runs_the_int8_gemm(smollm2_bf16):
    """Where the VNNI GEMM runs and AMX does not, the head keeps its codes in the GEMM's layout and every
    call, of any row count, is the GEMM's: the hidden states quantized to int8 per group of 32 (llama.cpp's
    Q8_0 head), within that quantization's bound of the file's weights times the bf16 inputs."""
    model = _bf16_engine(smollm2_bf16, dense_copy=True).runner.model
    head = model.lm_head
    assert (head.gemm is not None) == (kernel.q8_gemm_available() and head.amx_blocks is None)
    if head.gemm is None:
        return  # another CPU: the paths above
    assert head.bf16_weight is None and head.dtype == torch.bfloat16  # no dense weight beside the GEMM's codes
    embed = smollm2_bf16.weights[smollm2_bf16.config.arch.global_name("embed")]
    assert torch.equal(model.embed_tokens(torch.arange(embed.shape[0])), embed)  # the loaded rows, from the codes
    gen = torch.Generator().manual_seed(5)
    w = head.dequantize().double()
    for rows in (1, BF16_KERNEL_BELOW_ROWS - 1, BF16_KERNEL_BELOW_ROWS, 32):
        x = torch.randn((rows, w.shape[1]), generator=gen).to(torch.bfloat16)
        logits = head(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, kernel.matmul_q8_head(x, head.gemm))
        bound = kernel.error_bound(x.float(), head.codes, head.scale).double()
        exact = x.double() @ w.t()
        assert ((logits.double() - exact).abs() <= bound + 1e-5 * exact.abs().max()).all()


def test_bf16_decode_steps_of_many_sequences_on_the_dense_copy_follow_the_packed_kernel(smollm2_bf16):
    """A decode step of DENSE_COPY_FROM_ROWS sequences runs the kept dense copy (the same bf16 weights
    as the codes, other sums): its logits stay within bf16 rounding noise of the packed kernel's, and
    the greedy token is the same wherever the top two logits are not near-tied."""
    tok = smollm2_bf16.tokenizer
    prompts = [tok.encode(f"Question {i}: what is {i} plus {i + 1}? Answer:") for i in range(DENSE_COPY_FROM_ROWS)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    logits = []
    for copy in (False, True):
        engine = _bf16_engine(smollm2_bf16, dense_copy=copy)
        qkv = engine.runner.model.layers[0].qkv
        linear = next(p for p in getattr(qkv, "parts", [qkv]) if isinstance(p, Int4Linear))
        assert (linear.dense is not None) == copy
        threshold = DENSE_PACKED_FROM_ROWS if linear.dense_packed else DENSE_COPY_FROM_ROWS  # oneDNN's layout or not
        assert linear.dense_from_rows == (threshold if copy else 128)
        engine.keep_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy)
        engine.step()  # the prompts
        engine.step()  # one decode step of all of them
        logits.append(engine.last_logits.clone())
    packed, dense = logits
    assert packed.shape == (DENSE_COPY_FROM_ROWS, smollm2_bf16.config.vocab_size)
    if linear.amx is not None:  # AMX-BF16: such steps run the AMX kernel with or without the copy
        assert torch.equal(packed, dense)  # (its weights are the copy's: tests/test_cpu_int4_amx.py)
        return
    if linear.q8_gemm is not None:  # AVX512-VNNI without AMX: with the copy such steps run the VNNI GEMM
        return  # (int8 inputs), against the copy's bf16 products in tests/test_cpu_q8_gemm.py
    assert not torch.equal(packed, dense)  # the dense copy did run
    diff = (packed - dense).abs()
    # bf16 noise: the logits are bf16 values (steps of 0.125 at SmolLM2's 8-32), and each layer's
    # output ulps carry through 30 layers (measured: mean 0.13, max 0.81). A wrong weight or row
    # would move them by whole units.
    assert diff.mean() < 0.25 and diff.max() < 2, (diff.mean(), diff.max())
    top2 = packed.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.5
    assert torch.equal(packed.argmax(-1)[clear], dense.argmax(-1)[clear]) and clear.sum() >= DENSE_COPY_FROM_ROWS // 2
