"""4-bit weights kept packed on the CPU, multiplied by torch's weight-packed int4 kernel.

Why: decoding a few streams reads every weight once per step, so on a CPU its speed is the memory
bandwidth over the weights' bytes; 4-bit codes are a quarter of bf16's. torch ships the kernel
(`torch._weight_int4pack_mm_for_cpu`, the "tinygemm" layout: codes packed along the output rows,
one scale and zero per group of input columns and output row, w = (q - 8) * scale + zero); no
hand-written kernel is needed. It is fast with bf16 (or fp16) activations, slow with fp32, and
slower than a dense bf16 matmul from about 16-32 rows on (it dequantizes per row tile). Over a
whole SmolLM2 decode step it wins up to 16 streams and loses a few percent at 32 (the step's other
costs hide the matmuls), at a quarter of the memory: `--weight-format auto` takes it where the
file's projections are 4-bit already and the compute is bf16/fp16 on a CPU.

Codes come from the GGUF file itself where its tensors are Q4_0 / Q4_1 (llama.cpp's blocks of 32:
w = d * (q - 8), resp. w = d * q + m), re-packed once at load: the same codes llama.cpp runs, with
the scales rounded to the activation dtype. Other weights (Q8_0, K-quants, float) are quantized
here by round-to-nearest over groups of 32 (asymmetric min/max), which adds error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # llama.cpp's Q4 block, and a group size torch's kernel takes
# From this many rows on (a prefill chunk), dequantizing the weight and running a dense matmul beats
# the kernel, whose cost grows with every row (about 2.3x a dense bf16 matmul's per row), while the
# dequantization costs as much as 100-150 rows: crossover 128-192 rows on SmolLM2's shapes at 1 and
# 2 threads; at 256 rows 1.4x faster, at 512 about 2x.
DENSE_FROM_ROWS = 192
_Q4_0, _Q4_1 = 2, 3  # GGMLQuantizationType values


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """A weight [N, K] as 4-bit codes: w[n, k] = (codes[n, k] - 8) * scale[n, g] + zero[n, g], g = k // 32."""

    codes: torch.Tensor  # [N, K] uint8 in [0, 15]
    scale: torch.Tensor  # [N, K / 32] float32
    zero: torch.Tensor  # [N, K / 32] float32
    act_dtype: torch.dtype = torch.bfloat16  # what the layer multiplies them with

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def to(self, device: str | torch.device) -> Int4Codes:
        if torch.device(device).type != "cpu":
            raise ValueError("int4 packed weights run on the CPU only")
        return self

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        n, k = self.codes.shape
        groups = (self.codes.float() - 8).view(n, k // GROUP, GROUP)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, order: torch.Tensor) -> Int4Codes:
        """The same weight with its output rows reordered (`order`: [N] row indices)."""
        return Int4Codes(self.codes[order], self.scale[order], self.zero[order], self.act_dtype)

    def for_dtype(self, dtype: torch.dtype) -> Int4Codes:
        return Int4Codes(self.codes, self.scale, self.zero, dtype)


def quantize_rtn(weight: torch.Tensor) -> Int4Codes:
    """Round-to-nearest 4-bit codes of a float weight [N, K] (K a multiple of 32), asymmetric per
    group of 32: the group's min and max are exact, the rest within half a step."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Codes(codes.view(n, k), scale, lo + 8 * scale)


def codes_of_gguf_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Int4Codes | None:
    """The codes of a Q4_0 / Q4_1 tensor from its raw blocks (None for any other type).

    Blocks of 32 weights along a row: Q4_0 = fp16 d + 16 bytes, Q4_1 = fp16 d + fp16 m + 16 bytes;
    byte j holds weight j in its low nibble and weight j + 16 in its high one."""
    if ggml_type not in (_Q4_0, _Q4_1):
        return None
    n, k = shape
    head = 2 if ggml_type == _Q4_0 else 4
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, head + GROUP // 2)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    qs = torch.from_numpy(blocks[..., head:].copy())  # [N, G, 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).view(n, k)  # [N, K]
    if ggml_type == _Q4_0:
        return Int4Codes(codes, d, torch.zeros_like(d))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return Int4Codes(codes, d, m + 8 * d)  # d * q + m = (q - 8) * d + (m + 8 d)


def read_gguf_codes(path: Path, names: dict[str, str]) -> dict[str, Int4Codes]:
    """{HF name: codes} of the tensors of `names` ({GGUF name: HF name}) that are Q4_0 / Q4_1 in
    the file; the rows are as the file stores them (undo llama.cpp's Q/K permutation after)."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        hf = names.get(t.name)
        if hf is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        codes = codes_of_gguf_blocks(np.asarray(t.data), int(t.tensor_type), shape)
        if codes is not None:
            out[hf] = codes
    return out


class Int4Linear:
    """y = x @ W^T (+ b) with W as packed 4-bit codes; x in `dtype` (bf16 or fp16), any row count.

    Two packings of the same codes: the kernel's (opaque layout) for steps of few rows, and ours
    (two codes a byte, columns 2j and 2j+1) to dequantize from for steps of `DENSE_FROM_ROWS` or
    more. Both together, with one set of scales, are a little over half of the bf16 matrix's bytes."""

    __slots__ = ("packed", "scales_and_zeros", "nibbles", "scale", "zero", "bias", "out_features", "in_features",
                 "dtype")

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None = None) -> None:
        n, k = codes.codes.shape
        dtype = codes.act_dtype
        if k % GROUP:
            raise ValueError(f"int4 weights need input features divisible by {GROUP}, got {k}")
        self.packed = torch._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 1)
        # [K / 32, N, 2]: the kernel's layout of (scale, zero) per group and output row.
        self.scales_and_zeros = torch.stack([codes.scale.t(), codes.zero.t()], dim=-1).to(dtype).contiguous()
        self.nibbles = codes.codes[:, 0::2] | (codes.codes[:, 1::2] << 4)  # [N, K / 2] uint8
        self.scale = self.scales_and_zeros[..., 0].t()  # [N, K / 32] views: the kernel's rounded values
        self.zero = self.scales_and_zeros[..., 1].t()
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features, self.in_features, self.dtype = n, k, dtype

    @classmethod
    def fused(cls, parts: Sequence[Int4Codes], bias: torch.Tensor | None = None) -> Int4Linear:
        """One linear whose outputs are the parts' outputs concatenated (fused q/k/v, gate/up)."""
        return cls(Int4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                             torch.cat([p.zero for p in parts]), parts[0].act_dtype), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if x.shape[0] >= DENSE_FROM_ROWS:
            return F.linear(x, self.dequantized(), self.bias)
        y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scales_and_zeros)  # [N, out]
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype, from the codes and the kernel's scales."""
        n, k = self.out_features, self.in_features
        codes = torch.stack([self.nibbles & 0x0F, self.nibbles >> 4], dim=-1).view(n, k // GROUP, GROUP)
        # In fp32, rounded once at the end, as the kernel does: both paths multiply the same weight.
        w = (codes.float() - 8) * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.view(n, k).to(self.dtype)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return (self.packed.numel() * self.packed.element_size() + self.nibbles.numel()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size() + b)


def weights_for(checkpoint, config) -> tuple[dict[str, torch.Tensor | Int4Codes], str]:
    """(the weights an engine of `config` runs on `checkpoint`, "dense" or "int4"): --weight-format
    resolved (auto: int4 when every projection is Q4_0/Q4_1 in the GGUF file and the compute is
    bf16/fp16 on the CPU)."""
    fmt, model = config.weight_format, checkpoint.config
    gguf = checkpoint.source if checkpoint.source.suffix == ".gguf" else None
    packable = config.dtype in ("bfloat16", "float16") and config.device.startswith("cpu")
    if fmt == "dense" or (fmt == "auto" and (gguf is None or not packable)):
        return checkpoint.weights, "dense"
    names = model.arch.projection_names(model)
    codes = read_gguf_codes(gguf, {model.arch.to_gguf(n): n for n in names}) if gguf else {}
    if fmt == "auto" and len(codes) < len(names):
        return checkpoint.weights, "dense"  # not a 4-bit file: packing would add quantization error
    return pack_weights(checkpoint.weights, model, getattr(torch, config.dtype), codes), "int4"


def pack_weights(weights: dict[str, torch.Tensor], config, act_dtype: torch.dtype,
                 from_file: dict[str, Int4Codes] | None = None) -> dict[str, torch.Tensor | Int4Codes]:
    """`weights` with every projection (config.arch.projection_names) as 4-bit codes for `act_dtype`:
    the file's own (`from_file`, read_gguf_codes: rows put back in HF order here, as the reader
    does) where it has them, round-to-nearest of the float weight otherwise. Norms, embeddings and
    the output head stay as they are."""
    from pdserve.runtime.gguf_reader import unpermute_rope_rows

    arch = config.arch
    out: dict[str, torch.Tensor | Int4Codes] = dict(weights)
    for name in arch.projection_names(config):
        codes = (from_file or {}).get(name)
        if codes is None:
            codes = quantize_rtn(weights[name])
        else:
            heads = arch.gguf_permuted_heads(name, config)
            if heads is not None:
                order = unpermute_rope_rows(torch.arange(codes.shape[0])[:, None], heads)[:, 0]
                codes = codes.rows(order)
        out[name] = codes.for_dtype(act_dtype)
    return out
