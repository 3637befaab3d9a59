"""What a quantized weight format is, and the error raised when one is unsupported or inconsistent."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_BITS = (4, 8)
# Group sizes `pdserve quantize` makes; -1 = one group per output channel (the whole input row).
# Checkpoints made elsewhere may use any positive group size.
QUANTIZE_GROUP_SIZES = (-1, 32, 64, 128)
METHODS = ("rtn", "gptq")


class QuantError(ValueError):
    """A quantization request or a quantized checkpoint that cannot be honoured; the message says why."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How a weight matrix [out, in] is turned into integer codes.

    code = clamp(round(w / scale) + zero, 0, 2**bits - 1); w ~ (code - zero) * scale, with one
    (scale, zero) per output channel and group of `group_size` input channels (-1: one group).
    sym: zero fixed at 2**(bits-1), scale = max|w| / (2**(bits-1) - 1); else zero from the range.
    desc_act: GPTQ visits input columns in decreasing Hessian diagonal (activation order); groups
    are then formed in that order and `g_idx` maps each input channel to its group.
    """

    bits: int
    group_size: int = -1
    sym: bool = True
    desc_act: bool = False

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise QuantError(f"unsupported bits {self.bits} (supported: {', '.join(map(str, SUPPORTED_BITS))})")
        if self.group_size != -1 and self.group_size <= 0:
            raise QuantError(f"group size must be positive or -1 (per output channel), got {self.group_size}")

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int) -> int:
        """Number of groups over `in_features` inputs; the last one is shorter when G does not divide it."""
        g = in_features if self.group_size == -1 else self.group_size
        return -(-in_features // g)

    def group_len(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def check_quantize_request(bits: int, group_size: int, method: str, asym: bool = False) -> QuantSpec:
    """The spec `pdserve quantize` makes for these flags: INT8 symmetric (asymmetric with `asym`,
    a zero point per channel: on stories260K it keeps more top-1 choices), INT4 asymmetric."""
    if method not in METHODS:
        raise QuantError(f"unsupported method {method!r} (supported: {', '.join(METHODS)})")
    if group_size not in QUANTIZE_GROUP_SIZES:
        raise QuantError(f"unsupported group size {group_size} "
                         f"(supported: {', '.join(map(str, QUANTIZE_GROUP_SIZES))}; -1 = per output channel)")
    return QuantSpec(bits=bits, group_size=group_size, sym=bits == 8 and not asym)
