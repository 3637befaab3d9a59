"""A GGUF's own block codes (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K), read as they are and served packed.

Why: a GGUF's projections are already quantized; dequantizing them to dense float at load throws
the codes away and reads 2-4x the bytes per decode step. This module reads the blocks' codes and
scales exactly (`BlockCodes.dequantize` equals `gguf.quants.dequantize` bit for bit, checked in
tests/test_gguf_packed.py) and hands them to torch's CPU int4 kernel (`int4_cpu.Int4Linear`):

- 4-bit codes (Q4_0, Q4_1, Q4_K) are one plane: w = (q - 8) * scale + zero per group of 32. Q4_K's
  6-bit sub-block scales and mins are groups of 32 too: scale = d * sc, zero = 8 * scale - dmin * m.
- 8-bit codes (Q8_0) and 5-bit ones (Q5_K) are split into two 4-bit planes, u = 16 h + l: the
  kernel runs on [x, x] against [h | l] with the high plane's scale 16x the low plane's, so that
  one call sums both in fp32. The codes stay 8 bits a weight (plus bf16 scales), and the result is
  the dequantized weight's up to the scales' rounding to the activation dtype.
- Q6_K has one scale per 16 weights, which the kernel's groups (32 or more) cannot express without
  widening the codes: such tensors are dequantized at load (logged), the rest stay packed.

`weights_for` resolves `--weight-format` (auto / dense / int4 / packed) into the weights an engine
runs, a GPTQ checkpoint's included (its codes converted by pdserve.quant.gptq_cpu).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.quant.gptq_cpu import gptq_weights, has_gptq_weights
from pdserve.quant.int4_codes import GROUP, Int4Codes, pack_weights
from pdserve.runtime.config import FOUR_BIT_FORMATS
from pdserve.runtime.kernels import cpu_int4_matmul

log = logging.getLogger(__name__)

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # GGMLQuantizationType values
_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# (weights per block, bytes per block) of the types read here
_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
FOUR_BIT_TYPES = frozenset({Q4_0, Q4_1, Q4_K})
PACKED_TYPES = FOUR_BIT_TYPES | {Q8_0, Q5_K}
# Served dense beside packed tensors: their scales are per 16 weights (the kernel's groups are >= 32).
DENSE_AT_LOAD_TYPES = frozenset({Q6_K})


class PackedFormatError(ValueError):
    """A tensor's bytes do not fit its GGML type (wrong row length for the block, truncated data)."""


@dataclass(frozen=True, slots=True)
class BlockCodes:
    """A GGUF weight [N, K] as unsigned codes: w[n, k] = scale[n, g] * codes[n, k] - min[n, g], g = k // 32.

    The formula (one product and one difference in fp32) is gguf's own for every type read here, so
    `dequantize` matches gguf.quants.dequantize bit for bit. Q8_0's signed codes are stored + 128
    (min = 128 d)."""

    codes: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N, K / 32] float32
    min: torch.Tensor  # [N, K / 32] float32
    bits: int  # 4, 5 or 8: the codes' range

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        n, k = self.codes.shape
        groups = self.codes.float().view(n, k // GROUP, GROUP)
        return (groups * self.scale[..., None] - self.min[..., None]).view(n, k)


def check_blocks(ggml_type: int, shape: tuple[int, ...], nbytes: int) -> None:
    """Raise PackedFormatError unless a tensor of `shape` fits whole blocks of `ggml_type` in `nbytes`."""
    if ggml_type not in _BLOCKS:
        return
    per_block, block_bytes = _BLOCKS[ggml_type]
    name = _NAMES[ggml_type]
    if shape[-1] % per_block:
        raise PackedFormatError(f"{name} rows of {shape[-1]} weights are not whole {per_block}-weight blocks")
    want = int(np.prod(shape)) // per_block * block_bytes
    if nbytes != want:
        raise PackedFormatError(f"{name} data of shape {tuple(shape)} is {nbytes} bytes, expected {want} (truncated?)")


def parse_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> BlockCodes | None:
    """The codes of a tensor of type `ggml_type` (None where it is not a PACKED_TYPES type)."""
    if ggml_type not in PACKED_TYPES:
        return None
    check_blocks(ggml_type, shape, raw.nbytes)
    n, k = shape
    per_block, block_bytes = _BLOCKS[ggml_type]
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, k // per_block, block_bytes)
    codes = _PARSERS[ggml_type](blocks, n, k)
    if not (bool(torch.isfinite(codes.scale).all()) and bool(torch.isfinite(codes.min).all())):
        raise PackedFormatError(f"{_NAMES[ggml_type]} scales are not finite (corrupt data, or not of this type)")
    return codes


def _f16(b: np.ndarray) -> torch.Tensor:
    """fp16 values from [..., 2] bytes, as float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """[N, G, 16] bytes -> [N, G, 32] codes: byte j holds weight j (low nibble) and j + 16 (high)."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _q4_0(blocks: np.ndarray, n: int, k: int) -> BlockCodes:  # fp16 d, 16 bytes: w = d (q - 8)
    d = _f16(blocks[..., 0:2])
    return BlockCodes(_nibbles(blocks[..., 2:]).reshape(n, k), d, 8 * d, 4)


def _q4_1(blocks: np.ndarray, n: int, k: int) -> BlockCodes:  # fp16 d, fp16 m, 16 bytes: w = d q + m
    return BlockCodes(_nibbles(blocks[..., 4:]).reshape(n, k), _f16(blocks[..., 0:2]), -_f16(blocks[..., 2:4]), 4)


def _q8_0(blocks: np.ndarray, n: int, k: int) -> BlockCodes:  # fp16 d, 32 int8: w = d q
    d = _f16(blocks[..., 0:2])
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:])) ^ 0x80  # int8 q -> q + 128
    return BlockCodes(codes.reshape(n, k), d, 128 * d, 8)


def _k_scales(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-block: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of
    32 -> (d * sc, dmin * m), each [N, K / 32] (gguf's Q4_K.get_scale_min)."""
    s = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:16])).view(n, -1, 3, 4)
    a, b, c = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1).view(n, k // GROUP)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1).view(n, k // GROUP)
    d = _f16(blocks[..., 0:2]).repeat_interleave(8, dim=1)
    dmin = _f16(blocks[..., 2:4]).repeat_interleave(8, dim=1)
    return d * sc.float(), dmin * mn.float()


def _k_low_nibbles(qs: np.ndarray, n: int) -> torch.Tensor:
    """K-quant's 128 code bytes -> [N, S, 256] low 4 bits: chunk c of 32 bytes holds weights 64c + j
    (low nibble) and 64c + 32 + j (high)."""
    q = torch.from_numpy(np.ascontiguousarray(qs)).view(n, -1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=3).view(n, -1, 256)


def _q4_k(blocks: np.ndarray, n: int, k: int) -> BlockCodes:  # w = d sc q - dmin m
    scale, mn = _k_scales(blocks, n, k)
    return BlockCodes(_k_low_nibbles(blocks[..., 16:144], n).reshape(n, k), scale, mn, 4)


def _q5_k(blocks: np.ndarray, n: int, k: int) -> BlockCodes:  # + 32 bytes qh: bit c of byte j is weight 32c + j's 5th
    scale, mn = _k_scales(blocks, n, k)
    qh = torch.from_numpy(np.ascontiguousarray(blocks[..., 16:48])).view(n, -1, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1  # [N, S, 8, 32]
    codes = _k_low_nibbles(blocks[..., 48:176], n) | (high.view(n, -1, 256) << 4)
    return BlockCodes(codes.reshape(n, k), scale, mn, 5)


_PARSERS = {Q4_0: _q4_0, Q4_1: _q4_1, Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k}


def int4_codes(codes: BlockCodes) -> Int4Codes:
    """The kernel's form of `codes`: one 4-bit plane, or (5 and 8 bits) two planes [high | low].

    Two planes: u = 16 h + l; the high plane is (h - 8) * 16 s (zero 0), the low one (l - 8) * s + z
    with z = 136 s - min, so that their sum is s u - min. 5-bit codes are shifted by 128 first (h in
    {8, 9}), which makes z = 8 s - min: as small as a 4-bit format's zero, so its rounding to bf16
    costs no more."""
    if codes.bits == 4:
        return Int4Codes(codes.codes, codes.scale, 8 * codes.scale - codes.min)
    shift = 128 if codes.bits == 5 else 0
    u = codes.codes + shift
    s = codes.scale
    return Int4Codes(torch.cat([u >> 4, u & 0x0F], dim=1), torch.cat([16 * s, s], dim=1),
                     torch.cat([torch.zeros_like(s), (136 - shift) * s - codes.min], dim=1), planes=2)


def read_packed(path: Path, names: dict[str, str]) -> tuple[dict[str, BlockCodes], dict[str, str]]:
    """({HF name: codes} of the tensors of `names` ({GGUF name: HF name}) in PACKED_TYPES,
    {HF name: GGML type name} of every tensor of `names`). Rows as the file stores them."""
    from pdserve.runtime import gguf_tensors
    from pdserve.runtime.loader import ModelLoadError

    packed, types = {}, {}
    for t in gguf_tensors.tensors(path):
        hf = names.get(t.name)
        if hf is None:
            continue
        types[hf] = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            codes = parse_blocks(np.asarray(t.data), int(t.tensor_type), shape)
        except PackedFormatError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from e
        if codes is not None:
            packed[hf] = codes
    return packed, types


def weights_for(checkpoint, config) -> tuple[dict[str, object], str]:
    """(the weights an engine of `config` runs on `checkpoint`, the format: "dense", "int4",
    "int4-exact" or "packed").

    auto, on the CPU with bf16/fp16 compute: a GGUF whose projections are all Q4_0/Q4_1 -> "int4" (as
    before); all in PACKED_TYPES or DENSE_AT_LOAD_TYPES, at least one packed -> "packed"; else dense.
    auto, on the CPU with fp32 compute (a CPU without native bf16): a GGUF whose projections are all
    Q4_0/Q4_1 -> "int4-exact", the file's codes times unquantized fp32 inputs (cpu_int4_matmul's
    W4A32 kernel: the dequantized weights' outputs to fp32 rounding, at the codes' bytes a step);
    else dense. (int4 in fp32 quantizes the inputs to int8 as llama.cpp's Q4_1 x Q8_1 does, which
    costs SmolLM2 answers, "Paris" among them: docs/quantization.md; taken when asked for.)
    int4 / int4-exact: every projection 4-bit (the file's 4-bit codes, round-to-nearest for the
    rest). packed: the file's codes where it has them, the loaded dense weight elsewhere. A GPTQ
    checkpoint's codes are converted alike (pdserve.quant.gptq_cpu.gptq_weights; auto takes them
    too, with bf16/fp16 compute)."""
    fmt, model = config.weight_format, checkpoint.config
    gguf = checkpoint.source if checkpoint.source.suffix == ".gguf" else None
    on_cpu = config.device.startswith("cpu")
    packable = config.dtype in ("bfloat16", "float16") and on_cpu
    exact_auto = config.dtype == "float32" and on_cpu and gguf is not None and cpu_int4_matmul.available()
    if fmt == "dense" or (fmt == "auto" and not (packable or exact_auto)):
        return checkpoint.weights, "dense"
    act = getattr(torch, config.dtype)
    if gguf is None and has_gptq_weights(checkpoint.weights, model):  # a GPTQ checkpoint's own codes
        return gptq_weights(checkpoint.weights, model, act, "int4" if fmt == "int4-exact" else fmt)
    if fmt == "auto" and gguf is None:
        return checkpoint.weights, "dense"
    names = model.arch.projection_names(model)
    codes, types = read_packed(gguf, {model.arch.to_gguf(n): n for n in names}) if gguf else ({}, {})
    if fmt == "auto":
        served = {_NAMES[t] for t in PACKED_TYPES | DENSE_AT_LOAD_TYPES} if packable else {"Q4_0", "Q4_1"}
        if not codes or len(types) < len(names) or not set(types.values()) <= served:
            return checkpoint.weights, "dense"  # float projections: packing would add quantization error
        four_bit = "int4" if packable else "int4-exact"
        fmt = four_bit if set(types.values()) <= {"Q4_0", "Q4_1"} else "packed"
    if fmt in FOUR_BIT_FORMATS:
        four = {n: int4_codes(c) for n, c in codes.items() if c.bits == 4}
        return pack_weights(checkpoint.weights, model, act, four, exact_inputs=fmt == "int4-exact"), fmt
    return packed_weights(checkpoint.weights, model, act, codes, types), "packed"


def packed_weights(weights: dict[str, torch.Tensor], config, act_dtype: torch.dtype, codes: dict[str, BlockCodes],
                   types: dict[str, str]) -> dict[str, object]:
    """`weights` with the projections of `codes` as the kernel's codes (rows back in HF order), the
    others kept as loaded, with one log line saying which, of what type, and why."""
    kept = {n: types.get(n, "float") for n in config.arch.projection_names(config) if n not in codes}
    if kept:
        kinds = sorted(set(kept.values()))
        why = ("Q6_K has one scale per 16 weights, finer than the int4 kernel's groups of 32" if kinds == ["Q6_K"]
               else "types the int4 kernel does not take")
        log.info("weight format packed: %d of %d projections (%s) are dequantized at load to %s (%s)",
                 len(kept), len(kept) + len(codes), ", ".join(kinds), str(act_dtype).removeprefix("torch."), why)
    four = {n: int4_codes(c) for n, c in codes.items()}
    return pack_weights(weights, config, act_dtype, four, rtn_others=False)
