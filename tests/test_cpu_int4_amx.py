"""The AMX kernel (kernels/cpu/int4_amx.c): bf16 steps of 5-95 rows of a 4-bit linear multiply the
dense copy's weights on AMX tiles. Its weights are `Int4Linear.dequantized()` bit for bit (identity
rows read them back), its outputs are the dense bf16 matmul's within the fp32 sums' order, a row's
bits depend neither on the other rows of its call nor on the thread count, and a fused linear's part
equals that part alone. Runs only on a CPU with AMX-BF16 (elsewhere the kernel is not built in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.quant.int4_cpu import Int4Linear
from pdserve.quant.int4_codes import quantize_rtn
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.kernels.cpu_int4_matmul import AMX_BELOW_ROWS

pytestmark = pytest.mark.skipif(not cpu_int4_matmul.amx_available(), reason="needs a CPU with AMX-BF16")

SHAPES = [(96, 64), (64, 576), (576, 1536)]  # [out, in]: small, and SmolLM2's down projection


def _linear(n: int, k: int, seed: int, bias: bool = False) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    codes = quantize_rtn(torch.randn(n, k, generator=gen))
    return Int4Linear(codes, torch.randn(n, generator=gen) if bias else None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_its_weights_are_the_dense_copys_bit_for_bit(n, k):
    lin = _linear(n, k, seed=n + k)
    assert lin.amx is not None and lin.packed is None  # the AMX kernel runs; torch's packing is not kept
    eye = torch.eye(k, dtype=torch.bfloat16)
    read_back = torch.cat([lin(eye[i:i + 32]) for i in range(0, k, 32)])  # [k, n]: row i = column i of w
    assert torch.equal(read_back.t(), lin.dequantized())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [5, 16, 17, 32, 33, AMX_BELOW_ROWS - 1])
def test_it_equals_the_dense_bf16_matmul_within_the_sums_order(n, k, rows):
    lin = _linear(n, k, seed=rows, bias=True)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    w = lin.dequantized()
    want = F.linear(x.float(), w.float(), lin.bias.float())  # the same products, summed in fp64-ish fp32
    got = lin(x)
    dense = F.linear(x, w, lin.bias)  # oneDNN's bf16 matmul of the same weights
    # Both round one fp32 sum to bf16: within a bf16 ulp of the largest output, as the dense matmul is.
    tolerance = 2 ** -7 * want.abs().max()
    assert (got.float() - want).abs().max() <= tolerance
    assert (dense.float() - want).abs().max() <= tolerance


def test_from_its_row_limit_on_the_dense_matmul_runs():
    lin = _linear(96, 64, seed=3)
    x = torch.randn(AMX_BELOW_ROWS, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(lin(x), F.linear(x, lin.dequantized()))


def test_a_rows_bits_depend_on_neither_the_other_rows_nor_the_threads():
    lin = _linear(576, 1536, seed=5)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(6)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = lin(x)
        torch.set_num_threads(2)
        assert torch.equal(lin(x), one_thread)
    finally:
        torch.set_num_threads(threads)
    for start, stop in ((0, 5), (7, 40), (30, 64)):  # other row counts, other tile row groups
        assert torch.equal(lin(x[start:stop]), one_thread[start:stop])


def test_a_fused_linears_part_equals_that_part_alone():
    gen = torch.Generator().manual_seed(7)
    q, kv = quantize_rtn(torch.randn(96, 64, generator=gen)), quantize_rtn(torch.randn(64, 64, generator=gen))
    x = torch.randn(20, 64, generator=gen).bfloat16()
    fused = Int4Linear.fused([q, kv])
    assert torch.equal(fused(x)[:, :96], Int4Linear(q)(x)) and torch.equal(fused(x)[:, 96:], Int4Linear(kv)(x))
