"""4- and 8-bit weights times fp32 activations on the CPU with the C functions of
kernels/cpu/int4_matmul.c (inputs quantized to int8) and int4_exact.c (inputs as they are), built
into cpu_attention's library.

torch's CPU int4 kernel is fast with bf16 / fp16 activations only; where the compute dtype is fp32
(a CPU without native bf16) it is slower than the dense fp32 matmul. The C kernel quantizes each
input row to int8 per group of 32 and takes integer dot products with the codes, as llama.cpp does
for Q4_1 and Q8_0; its error beside fp32 rounding is that quantization's (`error_bound`).
`matmul` / `matmul_int8` return None where they do not apply (no library, another dtype): the caller
runs torch's path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdserve.runtime.kernels import cpu_attention

GROUP = 32
# Output rows per thread at least (below it the pool's hand-off costs more than the rows).
MIN_ROWS_PER_THREAD = 256
# bf16 steps of fewer rows than this run their 4-bit projections on the C kernel (`matmul_bf16`),
# their SiLU in C (cpu_layer_ops), and, decode-only, as one C call (cpu_decode_step): one stream's
# step is then mostly its weights' reading instead of 30 layers x 15 calls from Python. Larger steps
# take torch's int4 kernel (bf16 activations, exact) or the dense matmul.
BF16_Q8_BELOW_ROWS = 5


def available() -> bool:
    """Whether the library with the kernel is built (else torch's paths run)."""
    return cpu_attention.library() is not None


def supports(x: torch.Tensor) -> bool:
    """Whether the kernel runs a call on input `x`: fp32 [M, K] on the CPU, K a multiple of 32."""
    return (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % GROUP == 0
            and available())


def matmul(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] fp32 times the weight w[n, k] = q[n, k] * scale[n, k/32] + mins[n, k/32] (+ bias[n])
    -> y [M, N] fp32.

    nibbles: [N, K/2] uint8 (byte j: code 2j low, 2j + 1 high); scale, mins: [N, K/32] fp32, bias [N]
    fp32, all contiguous. None where the kernel does not apply (`supports`)."""
    if not supports(x):
        return None
    weights = (nibbles.data_ptr(), scale.data_ptr(), mins.data_ptr(), 0 if bias is None else bias.data_ptr())
    return _over_output_rows(x, nibbles.shape[0], cpu_attention.library().int4_linear_f32_threads, weights)


def matmul_exact(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """As `matmul` with the inputs as they are (W4A32): each weight dequantized in registers
    (q * scale + mins, one fma) times the fp32 input, so the result is the dequantized weight's
    matmul to fp32 rounding, with no int8 quantization of x. None where the kernel does not apply."""
    if not supports(x):
        return None
    weights = (nibbles.data_ptr(), scale.data_ptr(), mins.data_ptr(), 0 if bias is None else bias.data_ptr())
    return _over_output_rows(x, nibbles.shape[0], cpu_attention.library().int4_linear_exact_f32_threads, weights)


def matmul_int8_exact(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """As `matmul_int8` with the inputs as they are (W8A32): the dequantized weight's matmul to
    fp32 rounding. None where the kernel does not apply."""
    if not supports(x):
        return None
    return _over_output_rows(x, codes.shape[0], cpu_attention.library().int8_linear_exact_f32_threads,
                             (codes.data_ptr(), scale.data_ptr()))


def matmul_bf16(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """As `matmul` for x [M, K] bf16 -> y [M, N] bf16: x widened (exactly), the same int8 sums, plus
    bias [N] fp32, each output rounded once to bf16. None where it does not apply."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % GROUP == 0
            and available()):
        return None
    weights = (nibbles.data_ptr(), scale.data_ptr(), mins.data_ptr(), 0 if bias is None else bias.data_ptr())
    return _over_output_rows(x, nibbles.shape[0], cpu_attention.library().int4_linear_bf16_threads, weights, torch.bfloat16)


def matmul_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] fp32 times w[n, k] = codes[n, k] * scale[n, k/32] -> y [M, N] fp32; codes [N, K] int8
    in -127..127, scale [N, K/32] fp32, contiguous. None where the kernel does not apply."""
    if not supports(x):
        return None
    return _over_output_rows(x, codes.shape[0], cpu_attention.library().int8_linear_f32_threads,
                             (codes.data_ptr(), scale.data_ptr()))


def _over_output_rows(x: torch.Tensor, n: int, linear, weights: tuple[int, ...],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, n] (`dtype`) by the C `linear(x, m, k, x_stride, *weights, n, y, y_stride, threads)`, which
    splits the n outputs over threads (each part quantizes x itself: no tensors in between). The
    caller has checked that the kernel applies to x."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=dtype)
    if linear(x.data_ptr(), m, k, x.stride(0), *weights, n, y.data_ptr(), n,
              cpu_attention.threads_for(n, MIN_ROWS_PER_THREAD)):
        raise MemoryError(f"no scratch for a {m} x {k} input's int8 quantization")
    return y


def error_bound(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                mins: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N]: the most the kernel's output may differ from x @ w^T through the inputs' int8
    quantization (each input off by at most half its group's step; the kernel multiplies the
    quantized inputs by w, its min included): sum_g xd / 2 sum_k |w|. codes: [N, K] (0..15, or
    int8); scale, mins: [N, K/32] (mins None: 8-bit codes, w = q scale). (fp32 rounding on top.)"""
    m, k = x.shape
    n = codes.shape[0]
    xd = x.view(m, k // GROUP, GROUP).abs().amax(-1) / 127  # [M, G]
    w = codes.float().view(n, k // GROUP, GROUP) * scale.float()[..., None]  # [N, G, 32]
    if mins is not None:
        w = w + mins.float()[..., None]
    return (xd / 2) @ w.abs().sum(-1).t()


@functools.cache
def bf16_available() -> bool:
    """Whether the bf16-input head kernel runs here (kernels/cpu/bf16_matmul.c: a CPU with
    AVX512-BF16, where the library is built for it); else the dense bf16 matmul runs."""
    lib = cpu_attention.library()
    return lib is not None and bool(lib.bf16_dot_available())


def matmul_int8_bf16(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] bf16 times w[n, k] = bf16(codes[n, k] * scale[n, k/32]) -> y [M, N] fp32 (logits),
    summed in fp32: the products of the dense bf16 matmul with w, in one fixed order a row.
    codes [N, K] int8 in -127..127, scale [N, K/32] fp32, contiguous. None where the kernel does
    not apply (not bf16 [M, K] on the CPU with K a multiple of 32, or no AVX512-BF16 build)."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % GROUP == 0
            and bf16_available()):
        return None
    return _over_output_rows(x, codes.shape[0], cpu_attention.library().int8_linear_bf16_threads,
                             (codes.data_ptr(), scale.data_ptr()))


# Where the CPU has AVX512-VNNI and no AMX, bf16 rows of generated tokens (any count) run on the
# VNNI GEMM (`matmul_q8_gemm`, Int4Linear): the sums of `matmul_bf16` (inputs quantized to int8 per group
# of 32, llama.cpp's Q4_1 x Q8_1), so a generated token's projections have the same arithmetic at every
# batch size, where steps of 8 or more took the dense bf16 copy before (the figures: int4_q8_gemm.c,
# `python benchmarks/q8_gemm_bench.py`). Prompt rows, and rows of no told kind (int4_cpu.token_kinds),
# keep exact bf16 products.
Q8_GEMM_PANEL = 16  # outputs a panel (int4_q8_gemm.c): n must be a multiple of it


@functools.cache
def q8_gemm_available() -> bool:
    """Whether the VNNI GEMM runs here (kernels/cpu/int4_q8_gemm.c built with AVX512-VNNI)."""
    lib = cpu_attention.library()
    return lib is not None and bool(lib.int4_q8_gemm_available())


def q8_gemm_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The VNNI GEMM's int8 quantization of x [M, K] bf16 (K a multiple of 32), as its calls take it:
    codes [M, K] int8, xd [M, K/32] (max |x| / 127 a group) and xsum [M, K/32] (xd times the codes' sum).
    For tests; None where the GEMM is not built."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] % GROUP == 0):
        raise ValueError(f"bf16 rows [M, K] with K a multiple of {GROUP} expected, got {x.dtype} {tuple(x.shape)}")
    if not q8_gemm_available():
        return None
    x = x.contiguous()
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xd, xsum = torch.empty(m, k // GROUP), torch.empty(m, k // GROUP)
    if cpu_attention.library().q8_quantize_bf16(x.data_ptr(), m, k, k, xq.data_ptr(), xd.data_ptr(), xsum.data_ptr()):
        raise MemoryError("q8_quantize_bf16: no scratch")
    return xq, xd, xsum


def q8_gemm_panels(nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> Q8GemmWeights:
    """The GEMM's layout of w[n, k] = q[n, k] * scale[n, k/32] + mins[n, k/32] (nibbles [N, K/2]: byte
    j holds codes 2j, 2j + 1): codes [N/16, K/8, 16, 4] uint8, byte i of lane l of block j holding input
    8j + i (low nibble) and 8j + 4 + i (high) of output 16 panel + l; scale, mins [N/16, K/32, 16]."""
    n, half = nibbles.shape
    codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).view(n, 2 * half)  # [N, K]
    k = codes.shape[1]
    quads = codes.view(n // Q8_GEMM_PANEL, Q8_GEMM_PANEL, k // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [N/16, K/8, 16, 2, 4]
    panels = (quads[..., 0, :] | (quads[..., 1, :] << 4)).contiguous()

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // Q8_GEMM_PANEL, Q8_GEMM_PANEL, k // GROUP).transpose(1, 2).contiguous()

    return Q8GemmWeights(panels, by_panel(scale), by_panel(mins))


@dataclass(frozen=True, slots=True)
class Q8GemmWeights:
    """A 4-bit projection in the VNNI GEMM's layout (`q8_gemm_panels`), or 8-bit codes (`q8_head_panels`)."""

    codes: torch.Tensor  # [N / 16, K / 8, 16, 4] uint8, two codes a byte; 8-bit: [N / 16, K / 4, 16, 4]
    scale: torch.Tensor  # [N / 16, K / 32, 16] fp32
    mins: torch.Tensor | None  # [N / 16, K / 32, 16] fp32; None for 8-bit codes (symmetric)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.mins) if t is not None)


def matmul_q8_gemm(x: torch.Tensor, weights: Q8GemmWeights, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """As `matmul_bf16` (x [M, K] bf16 -> y [M, N] bf16, the same quantized sums plus bias [N] fp32) on the
    register-tiled VNNI GEMM, for many rows. None where it does not apply."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % GROUP == 0
            and q8_gemm_available()):
        return None
    n = weights.codes.shape[0] * Q8_GEMM_PANEL
    w = (weights.codes.data_ptr(), weights.scale.data_ptr(), weights.mins.data_ptr(),
         0 if bias is None else bias.data_ptr())
    return _over_output_rows(x, n, cpu_attention.library().int4_q8_gemm_bf16_threads, w, torch.bfloat16)


def q8_head_panels(codes: torch.Tensor, scale: torch.Tensor) -> Q8GemmWeights:
    """The VNNI GEMM's layout of 8-bit codes w[n, k] = codes[n, k] * scale[n, k/32] (codes [N, K] int8 in
    -127..127, a Q8_0 head): codes + 128 as [N/16, K/4, 16, 4] uint8, byte i of lane l of block j holding
    input 4j + i of output 16 panel + l; scale as [N/16, K/32, 16] (int4_q8_gemm.c); no mins."""
    n, k = codes.shape
    shifted = codes.view(torch.uint8) ^ 0x80  # [N, K]: q + 128 (two's complement), no wider temporary
    panels = shifted.view(n // Q8_GEMM_PANEL, Q8_GEMM_PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // Q8_GEMM_PANEL, Q8_GEMM_PANEL, k // GROUP).transpose(1, 2).contiguous()

    return Q8GemmWeights(panels, by_panel(scale), None)


def matmul_q8_head(x: torch.Tensor, weights: Q8GemmWeights) -> torch.Tensor | None:
    """x [M, K] bf16 times 8-bit codes (`q8_head_panels`) -> y [M, N] fp32: the inputs quantized to int8 per
    group of 32 as every kernel here quantizes them, integer dot products on the VNNI GEMM. Each row's
    bits depend on nothing else in the call. None where it does not apply."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % GROUP == 0
            and q8_gemm_available()):
        return None
    n = weights.codes.shape[0] * Q8_GEMM_PANEL
    w = (weights.codes.data_ptr(), weights.scale.data_ptr())
    return _over_output_rows(x, n, cpu_attention.library().int8_q8_gemm_threads, w)


# bf16 calls of BF16_Q8_BELOW_ROWS up to this many rows run on the AMX kernel where the CPU has it
# (`matmul_amx`, Int4Linear): it reads the 4-bit codes, not the dense copy's 2 bytes a weight. SmolLM2's
# 30 layers' projections at one thread (Xeon with AMX, 2 cores): 17.8 / 14.8 / 18.7 / 23.8 ms at 8 / 16 /
# 32 / 64 rows against the dense copy's 21.3 / 21.7 / 24.6 / 27.7 (oneDNN, also on AMX); from 128 rows the
# dense copy wins (34.0 against 39.8 ms): prompts stay on it. Decode-only steps of fewer rows run whole
# in one C call there (cpu_decode_step), and their SiLU in C (cpu_layer_ops), eager or not.
AMX_BELOW_ROWS = 96
# Output rows a thread takes at least on the AMX kernel (whole panels of 32 below it cost more to hand off).
AMX_MIN_ROWS_PER_THREAD = 128
AMX_PANEL = 32  # output rows a panel (int4_amx.c): n and k must be multiples of it


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernel runs here (kernels/cpu/int4_amx.c: a CPU with AMX-BF16, the library
    built for it, and the kernel's permission for the tiles' state granted to this process)."""
    lib = cpu_attention.library()
    return lib is not None and bool(lib.int4_amx_available())


def amx_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> [N / 16, K / 32, 16, 16] uint8, the AMX kernel's layout: per block of
    16 outputs and 32 inputs, line r's byte i holds lane i's code (low nibble) and lane 16 + i's,
    lane 2c + j of line r being output c's input 2r + j (the tiles' pairs)."""
    lanes = _tile_pairs(codes)
    return (lanes[..., :16] | (lanes[..., 16:] << 4)).to(torch.uint8).contiguous()


def _tile_pairs(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K / 32, 16, 32]: per block of 16 outputs and 32 inputs, line r's lane 2c + j is
    output c's input 2r + j, the AMX tiles' pair order (both kernels' layouts start from it)."""
    n, k = codes.shape
    return codes.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def matmul_amx(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] bf16 times w[n, k] = bf16((q - 8) * scale + zero) plus bias [N] fp32 -> y [M, N] bf16: the
    dense bf16 matmul of those weights, summed in fp32 on AMX tiles. codes: `amx_codes`' layout;
    scales_and_zeros: [K / 32, N, 2] bf16, contiguous (torch's int4 kernel's layout).
    None where the kernel does not apply (not bf16 [M, K] on the CPU, K or N not a multiple of 32, or
    no AMX)."""
    return _on_amx(x, n, lambda lib, x_ptr, m, k, x_stride, y_ptr, threads: lib.int4_amx_linear_threads(
        x_ptr, m, k, x_stride, codes.data_ptr(), scales_and_zeros.data_ptr(), 0 if bias is None else bias.data_ptr(),
        n, y_ptr, n, threads))


def _on_amx(x: torch.Tensor, n: int, entry) -> torch.Tensor | None:
    """y [M, N] bf16 from `entry(lib, x, m, k, x_stride, y, threads)`, one of int4_amx.c's `_threads`
    entry points bound to its weights; None where the AMX kernels do not apply to x and n."""
    if not (x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] % AMX_PANEL == 0
            and n % AMX_PANEL == 0 and amx_available()):
        return None
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=torch.bfloat16)
    threads = cpu_attention.threads_for(n, AMX_MIN_ROWS_PER_THREAD)
    if entry(cpu_attention.library(), x.data_ptr(), m, k, x.stride(0), y.data_ptr(), threads):
        raise MemoryError(f"no scratch for a {n} x {k} weight's AMX panel")
    return y


def amx_int8_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8, scale [N, K / 32] fp32 -> [N / 16, K / 32, 576] uint8, the AMX kernel's 8-bit
    layout: per block of 16 outputs and 32 inputs, 16 lines of 32 codes (line r's byte 2c + j is output
    c's input 2r + j: the tiles' pairs), then the 16 outputs' fp32 scales of the block's group."""
    n, k = codes.shape
    lanes = _tile_pairs(codes).reshape(n // 16, k // 32, 512)
    scales = scale.float().view(n // 16, 16, k // 32).permute(0, 2, 1).contiguous()  # [N / 16, K / 32, 16]
    scale_bytes = scales.view(torch.uint8).view(n // 16, k // 32, 64)
    return torch.cat((lanes.view(torch.uint8), scale_bytes), dim=2).contiguous()


def matmul_int8_amx(x: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor | None:
    """x [M, K] bf16 times w[n, k] = bf16(q[n, k] * scale[n, k / 32]) -> y [M, N] bf16: the dense bf16
    matmul of those weights (the same bits where they are the loaded weight), summed in fp32 on AMX
    tiles, reading 1.1 bytes a weight instead of two. blocks: `amx_int8_blocks`' layout. None where the
    kernel does not apply (not bf16 [M, K] on the CPU, K or N not a multiple of 32, or no AMX)."""
    return _on_amx(x, n, lambda lib, x_ptr, m, k, x_stride, y_ptr, threads: lib.int8_amx_linear_threads(
        x_ptr, m, k, x_stride, blocks.data_ptr(), n, y_ptr, n, threads))
