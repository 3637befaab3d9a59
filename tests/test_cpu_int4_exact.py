"""4- and 8-bit weights times unquantized fp32 inputs in C (W4A32 / W8A32:
cpu_int4_matmul.matmul_exact / matmul_int8_exact) and the engine of `--weight-format int4-exact`,
which `auto` takes in fp32 for a GGUF of Q4_0/Q4_1 projections (a CPU without native bf16).

References: the float64 matmul of the dequantized weight (to fp32 rounding, far inside the int8
inputs' error), each row alone (bit for bit: a token's output does not depend on its batch), the
dense fp32 engine on the same codes, and transformers' answer to a chat question."""

from __future__ import annotations

import pytest
import torch

from pdserve.quant.int4_cpu import Int4Linear
from pdserve.quant.int4_codes import Int4Codes, weights_for
from pdserve.quant.q8_head import Q8Head, pack_head
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.kernels import cpu_int4_matmul as kernel
from test_cpu_int4_matmul import _dequantized, _nibbles, _random_int4

pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the CPU kernels")

# (rows, outputs, inputs): the last 1-3 rows in narrow tiles (int4_exact.c: up to 8 outputs x 1 row,
# 4 x 2, 2 x 3) after 8- and 4-row tiles, odd output counts (blocks of fewer than 8), one group; from
# 14 rows the panel GEMM: 16-row tiles, a last block of 5 rows, output tails
SHAPES = [(1, 577, 576), (2, 45, 64), (3, 64, 96), (5, 130, 64), (9, 7, 32), (32, 96, 576), (21, 47, 64)]


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: a generous fp32 rounding bound of x @ w^T (K products and sums, each within 2^-23)."""
    return 4 * x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.abs().t()) + 1e-30


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_exact_int4_kernel_is_the_dequantized_matmul_to_fp32_rounding(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n)
    codes, scale, mins = _random_int4(n, k, gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    w = _dequantized(codes, scale, mins)
    got = kernel.matmul_exact(x, _nibbles(codes), scale, mins, bias).double()
    want = x.double() @ w.t() + bias.double()
    assert ((got - want).abs() <= _fp32_bound(x, w) + 1e-6 * bias.abs().double()).all()
    # the int8 inputs' kernel is further off by orders of magnitude: the test tells them apart
    int8_inputs = kernel.matmul(x, _nibbles(codes), scale, mins, bias).double()
    assert (int8_inputs - want).abs().max() > 100 * (got - want).abs().max()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_exact_int8_kernel_is_the_dequantized_matmul_to_fp32_rounding(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + 1)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen)
    w = _dequantized(codes, scale, None)
    got = kernel.matmul_int8_exact(x, codes, scale).double()
    assert ((got - x.double() @ w.t()).abs() <= _fp32_bound(x, w)).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_gets_the_same_bits_alone_in_a_batch_strided_and_on_any_thread_count(threads):
    """Each row's sums run over the groups in one order whatever the call holds: rows alone equal
    rows together (a token's logits do not depend on its batch; a row alone: narrow tiles of 8
    outputs; 6 rows: a tile of 4 rows and 2 outputs, then narrow tiles of 2 rows and 4 outputs; 11 and
    13 rows: tiles of 8 rows and one output, then 3 rows in narrow tiles of 2 outputs, or a 4-row
    tile and one row; 21 and 29 rows: the panel GEMM's 6 x 16 tiles, then
    a last block of 5 rows in 12 x 8 tiles or of 13 in a 6 x 16 tile, and, for the head's 1030
    outputs, panels of fewer outputs), strided inputs equal contiguous ones, and threads split the
    outputs without changing a bit."""
    gen = torch.Generator().manual_seed(7)
    codes, scale, mins = _random_int4(1536, 576, gen)
    nib = _nibbles(codes)
    wide = torch.randn(29, 700, generator=gen)
    x = wide[:, :576]  # row stride 700
    c8 = torch.randint(-127, 128, (1030, 576), generator=gen, dtype=torch.int8)
    s8 = torch.rand(1030, 18, generator=gen) * 0.01
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernel.matmul_exact(x[i:i + 1], nib, scale, mins) for i in range(x.shape[0])])
        head_alone = torch.cat([kernel.matmul_int8_exact(x[i:i + 1], c8, s8) for i in range(x.shape[0])])
        for rows in (6, 11, 13, 21, 29):
            together = kernel.matmul_exact(x[:rows], nib, scale, mins)
            assert torch.equal(together, alone[:rows])
            assert torch.equal(together, kernel.matmul_exact(x[:rows].contiguous(), nib, scale, mins))
            assert torch.equal(kernel.matmul_int8_exact(x[:rows], c8, s8), head_alone[:rows])
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        assert torch.equal(alone, kernel.matmul_exact(x, nib, scale, mins))
    finally:
        torch.set_num_threads(before)


def test_exact_int4_linear_fused_equals_separate_and_keeps_its_inputs_exact():
    gen = torch.Generator().manual_seed(3)
    parts = [Int4Codes(c, s, m + 8 * s, torch.float32, exact_inputs=True)  # zero = mins + 8 scale
             for c, s, m in (_random_int4(n, 64, gen) for n in (64, 32, 32))]
    x = torch.randn(4, 64, generator=gen)
    fused = Int4Linear.fused(parts)
    assert fused.q8.exact
    assert torch.equal(fused(x), torch.cat([Int4Linear(p)(x) for p in parts], dim=-1))
    mixed = [parts[0], Int4Codes(parts[1].codes, parts[1].scale, parts[1].zero, torch.float32)]
    from pdserve.quant.int4_cpu import same_inputs

    assert not same_inputs(mixed)  # exact and int8 inputs are not one call


# ---- SmolLM2-135M-Instruct (Q4_1 projections, Q8_0 head) in fp32 ------------------------------------


def test_auto_in_float32_takes_the_files_codes_with_exact_inputs(smollm2):
    config = EngineConfig(cache=CacheConfig(num_blocks=8), dtype="float32", weight_format="auto")
    weights, fmt = weights_for(smollm2, config)
    assert fmt == "int4-exact"
    names = smollm2.config.arch.projection_names(smollm2.config)
    assert all(isinstance(weights[n], Int4Codes) and weights[n].exact_inputs for n in names)
    head = pack_head(weights, smollm2, config, fmt)[smollm2.config.arch.global_name("embed")]
    assert isinstance(head, Q8Head) and head.exact_inputs


def test_exact_int4_engine_follows_the_dense_engine_token_for_token(smollm2):
    """The same dequantized weights (the file's codes), the dense engine multiplying them as floats:
    greedy tokens equal, logits within fp32 rounding noise. The int8-input engine does not follow as
    closely (its logits are further off by orders of magnitude)."""
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.sampling_params import SamplingParams

    tok = smollm2.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))

    def run(fmt: str) -> tuple[list[int], list[torch.Tensor]]:
        engine = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=32), dtype="float32",
                                                              weight_format=fmt))
        assert engine.weight_format == fmt
        engine.keep_logits = True
        engine.add_request("r", list(ids), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens, logits = [], []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            logits.append(engine.last_logits[0].clone())
        return tokens, logits

    dense_tokens, dense_logits = run("dense")
    exact_tokens, exact_logits = run("int4-exact")
    _, int8_logits = run("int4")
    assert exact_tokens == dense_tokens
    assert "Paris" in smollm2.tokenizer.decode(exact_tokens)
    exact_err = max((a - b).abs().max().item() for a, b in zip(exact_logits, dense_logits))
    int8_err = max((a - b).abs().max().item() for a, b in zip(int8_logits, dense_logits))
    assert exact_err < 0.01 and int8_err > 10 * exact_err, (exact_err, int8_err)
