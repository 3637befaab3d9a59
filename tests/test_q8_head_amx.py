"""The 8-bit head on AMX tiles (kernels/cpu/int4_amx.c through cpu_int4_matmul.matmul_int8_amx,
pdserve.quant.q8_head): its widened weights are the loaded bf16 weight bit for bit (identity rows read
them back), its outputs the dense bf16 matmul's within the fp32 sums' order, a row's bits depend
neither on the other rows of its call nor on the thread count, and a Q8Head sends each step size to
its kernel. On a CPU without AMX-BF16 the tests check what runs there instead: the kernel steps aside
(None) and a head keeps no AMX blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.quant.q8_head import AMX_BELOW_ROWS, BF16_KERNEL_BELOW_ROWS, Q8Head
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_int4_matmul as kernel

AMX = kernel.amx_available()


def _head(v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [V, K] int8, scale [V, K/32] fp32, the weight bf16(codes * scale) [V, K])."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (v, k), generator=gen).to(torch.int8)
    scale = torch.rand((v, k // 32), generator=gen) * 1e-3
    return codes, scale, (codes.float().view(v, k // 32, 32) * scale[..., None]).view(v, k).to(torch.bfloat16)


def _amx(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    blocks = kernel.amx_int8_blocks(codes, scale)
    return kernel.matmul_int8_amx(x, blocks, codes.shape[0])


def test_the_blocks_hold_each_blocks_codes_in_tile_pairs_then_its_scales():
    codes, scale, _ = _head(32, 64, seed=1)
    blocks = kernel.amx_int8_blocks(codes, scale)  # [V / 16, K / 32, 576]
    assert blocks.shape == (2, 2, 576) and blocks.dtype == torch.uint8
    lines = blocks[1, 1, :512].view(torch.int8).view(16, 16, 2)  # [line r, output c, j]
    for r, c, j in ((0, 0, 0), (3, 5, 1), (15, 15, 1)):
        assert lines[r, c, j] == codes[16 + c, 32 + 2 * r + j]
    assert torch.equal(blocks[1, 1, 512:].view(torch.float32), scale[16:32, 1])


def test_its_weights_are_the_loaded_bf16_weights_bit_for_bit():
    codes, scale, w = _head(320, 96, seed=2)
    eye = torch.eye(96, dtype=torch.bfloat16)
    read_back = [_amx(eye[i:i + 32], codes, scale) for i in range(0, 96, 32)]  # row i: column i of w
    if not AMX:
        assert read_back == [None] * 3
        return
    assert torch.equal(torch.cat(read_back).t(), w)


def test_it_equals_the_dense_bf16_matmul_within_the_sums_order():
    codes, scale, w = _head(640, 576, seed=3)
    for rows in (BF16_KERNEL_BELOW_ROWS, 17, AMX_BELOW_ROWS - 1):
        x = torch.randn((rows, 576), generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        got = _amx(x, codes, scale)
        if not AMX:
            assert got is None
            continue
        exact = x.double() @ w.double().t()  # products of bf16 values are exact in fp32: only the sums round
        bound = (x.double().abs() @ w.double().abs().t()) * 576 * 2.0 ** -24 + exact.abs() * 2.0 ** -8
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 640)
        assert ((got.double() - exact).abs() <= bound).all()
        assert (got != F.linear(x, w)).float().mean() < 0.02  # mostly the dense matmul's own bits


def test_a_rows_bits_depend_on_neither_the_other_rows_nor_the_threads():
    codes, scale, _ = _head(2048, 576, seed=4)
    x = torch.randn((29, 576), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = _amx(x, codes, scale)
        alone = [_amx(x[i:i + 1].clone(), codes, scale) for i in (0, 13, 28)]
        torch.set_num_threads(2)
        split = _amx(x, codes, scale)
    finally:
        torch.set_num_threads(threads)
    if not AMX:
        assert together is None and split is None
        return
    assert torch.equal(together, split)
    assert all(torch.equal(together[i:i + 1], row) for i, row in zip((0, 13, 28), alone))


def test_it_steps_aside_where_it_does_not_apply():
    codes, scale, _ = _head(64, 64, seed=6)
    assert _amx(torch.randn(8, 64), codes, scale) is None  # fp32 inputs
    assert kernel.matmul_int8_amx(torch.randn(8, 64).bfloat16(), kernel.amx_int8_blocks(codes, scale), 48) is None
    odd_codes, odd_scale, odd_w = _head(336, 64, seed=9)  # a vocabulary not a multiple of the 32-row panel
    odd = Q8Head(odd_codes, odd_scale, dense=odd_w).with_amx_blocks()
    assert odd.amx_blocks is None  # kept off the tiles: its steps run the dense weight
    x = torch.randn((8, 64)).bfloat16()
    assert torch.equal(odd(x), F.linear(x, odd_w).float())


def test_a_head_sends_each_step_size_to_its_kernel():
    codes, scale, w = _head(320, 576, seed=7)
    head = Q8Head(codes, scale, dense=w).with_amx_blocks()
    assert (head.amx_blocks is not None) == AMX
    assert Q8Head(codes, scale).with_amx_blocks().amx_blocks is None  # fp32 compute: no blocks
    gen = torch.Generator().manual_seed(8)
    for rows in (BF16_KERNEL_BELOW_ROWS - 1, BF16_KERNEL_BELOW_ROWS, AMX_BELOW_ROWS - 1, AMX_BELOW_ROWS):
        x = torch.randn((rows, 576), generator=gen).to(torch.bfloat16)
        if rows < BF16_KERNEL_BELOW_ROWS:
            want = kernel.matmul_int8_bf16(x, codes, scale)
            want = F.linear(x, w) if want is None else want.to(torch.bfloat16)
        elif rows < AMX_BELOW_ROWS and AMX:
            want = _amx(x, codes, scale)
        else:
            want = F.linear(x, w)
        assert torch.equal(head(x), want.float())


def test_a_bf16_engine_keeps_amx_blocks_of_the_files_head_where_the_kernel_runs(smollm2_bf16):
    engine = Engine.from_checkpoint(smollm2_bf16, EngineConfig(
        cache=CacheConfig(num_blocks=64, dtype="bfloat16"), scheduler=SchedulerConfig(max_num_seqs=8),
        dtype="bfloat16", weight_format="auto"))
    head = engine.runner.model.lm_head
    if not isinstance(head, Q8Head):  # no AVX512-BF16: the dense bf16 head, and no AMX either
        assert not AMX and isinstance(head, torch.Tensor)
        return
    assert (head.amx_blocks is not None) == AMX
    if AMX:
        embed = smollm2_bf16.weights[smollm2_bf16.config.arch.global_name("embed")]
        eye = torch.eye(embed.shape[1], dtype=torch.bfloat16)[:32]
        read_back = kernel.matmul_int8_amx(eye, head.amx_blocks, embed.shape[0])  # [32, V]
        assert torch.equal(read_back.t(), embed[:, :32])  # the file's codes are the loaded weights
