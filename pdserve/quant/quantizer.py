"""Scale/zero choice per (output channel, group) and round-to-nearest quantization (RTN).

Scales are rounded up to float16 before codes are computed, because the checkpoint stores them in
float16 (GPTQ format): the codes must be the ones that the stored scale reconstructs best, and
rounding up keeps the group's range representable, so RTN's error stays within half a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.quant.spec import QuantSpec

# The smallest normal float16: smaller scales would underflow in the checkpoint.
_MIN_SCALE = 2.0 ** -14


@dataclass(frozen=True, slots=True)
class QuantResult:
    """A quantized matrix before packing."""

    codes: torch.Tensor  # [out, in] int64 in [0, maxq]
    scales: torch.Tensor  # [groups, out] float32 (float16-representable)
    zeros: torch.Tensor  # [groups, out] int64 in [1, maxq] (>= 1: see group_params)
    g_idx: torch.Tensor  # [in] int32: group of each input channel

    def dequantize(self) -> torch.Tensor:
        """-> [out, in] float32."""
        g = self.g_idx.long()
        return (self.codes - self.zeros[g].t()).float() * self.scales[g].t()


def _fp16_ceil(scale: torch.Tensor) -> torch.Tensor:
    """The smallest float16 value >= scale (>= the smallest normal float16), as float32."""
    s = scale.clamp(min=_MIN_SCALE)
    half = s.half()
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    return torch.where(half.float() < s, up, half).float()


def group_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, g] (one group of input channels) -> scale [out] float32, zero [out] int64.

    Asymmetric: the range always includes 0 (so 0 is exact), scale = range / maxq. The zero point
    is kept >= 1 because the classic GPTQ checkpoint stores zero - 1 in an unsigned b-bit field:
    a zero of 0 would be written as -1 and corrupt its neighbours. A group whose minimum is 0 (all
    weights >= 0) therefore gets zero 1 and scale max / (maxq - 1).
    """
    w = w.float()
    maxq = spec.maxq
    if spec.sym:
        half = 1 << (spec.bits - 1)
        scale = w.abs().amax(dim=1) / (half - 1)
        scale = _fp16_ceil(scale)
        return scale, torch.full_like(scale, half, dtype=torch.int64)
    lo = w.amin(dim=1).clamp(max=0)
    hi = w.amax(dim=1).clamp(min=0)
    scale = _fp16_ceil((hi - lo) / maxq)
    zero = torch.round(-lo / scale).to(torch.int64)
    floor = zero < 1
    scale = torch.where(floor, _fp16_ceil(hi / (maxq - 1)), scale)
    zero = zero.clamp(1, maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """w: [out, g], scale/zero: [out] -> codes [out, g] int64."""
    return (torch.round(w.float() / scale[:, None]) + zero[:, None]).clamp(0, maxq).to(torch.int64)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero[:, None]).float() * scale[:, None]


def contiguous_g_idx(in_features: int, spec: QuantSpec) -> torch.Tensor:
    """g_idx of groups over consecutive input channels (no activation order): [in] int32."""
    return (torch.arange(in_features) // spec.group_len(in_features)).to(torch.int32)


def rtn_quantize(w: torch.Tensor, spec: QuantSpec) -> QuantResult:
    """Round-to-nearest: w [out, in] -> codes with per-group scales from the weights alone."""
    out, n = w.shape
    g = spec.group_len(n)
    codes = torch.empty(out, n, dtype=torch.int64)
    scales, zeros = [], []
    for start in range(0, n, g):
        cols = w[:, start:start + g]
        scale, zero = group_params(cols, spec)
        codes[:, start:start + g] = quantize_codes(cols, scale, zero, spec.maxq)
        scales.append(scale)
        zeros.append(zero)
    return QuantResult(codes, torch.stack(scales), torch.stack(zeros), contiguous_g_idx(n, spec))
