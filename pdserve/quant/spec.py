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


# ---- activation quantization (W8A8) -------------------------------------------------------------

ACT_SCHEMES = ("dynamic", "static")
OBSERVERS = ("minmax", "percentile")
# `pdserve quantize --method` values that quantize activations too (weights INT8 per channel, symmetric).
ACT_METHODS = {"dynamic-int8": "dynamic", "w8a8": "static"}


@dataclass(frozen=True, slots=True)
class ActSpec:
    """How a projection's input activations are quantized to INT8 at run time.

    dynamic: per token (row), symmetric, scale = max|x| / 127 computed on each call.
    static: per projection input, asymmetric (scale and zero point fixed at calibration by
    `observer`: "minmax" takes the range seen, "percentile" the `percentile`-th and
    (100 - `percentile`)-th percentiles of all values, clipping rare outliers); inputs are clamped
    to that range.
    """

    scheme: str
    observer: str | None = None
    percentile: float = 99.99

    def __post_init__(self) -> None:
        if self.scheme not in ACT_SCHEMES:
            raise QuantError(f"unsupported activation scheme {self.scheme!r} (supported: {', '.join(ACT_SCHEMES)})")
        if self.scheme == "static" and self.observer not in OBSERVERS:
            raise QuantError(f"static activation scales need an observer ({' or '.join(OBSERVERS)}), "
                             f"got {self.observer!r}")
        if self.scheme == "dynamic" and self.observer is not None:
            raise QuantError("dynamic activation quantization takes no observer (scales are computed per token)")
        if not 50.0 < self.percentile <= 100.0:
            raise QuantError(f"percentile must be in (50, 100], got {self.percentile}")

    def to_json(self) -> dict:
        """The checkpoint's `quantization_config.pdserve.activations` entry."""
        if self.scheme == "dynamic":
            return {"scheme": "dynamic", "bits": 8, "granularity": "token", "sym": True}
        raw = {"scheme": "static", "bits": 8, "granularity": "tensor", "sym": False, "observer": self.observer}
        return raw | ({"percentile": self.percentile} if self.observer == "percentile" else {})

    @classmethod
    def from_json(cls, raw: object) -> ActSpec:
        if not isinstance(raw, dict):
            raise QuantError(f"quantization_config.pdserve.activations must be an object, got {raw!r}")
        if raw.get("bits", 8) != 8:
            raise QuantError(f"unsupported activation bits {raw.get('bits')!r} (only 8)")
        try:
            return cls(raw.get("scheme"), raw.get("observer"), float(raw.get("percentile", 99.99)))
        except (TypeError, ValueError) as e:
            raise QuantError(f"quantization_config.pdserve.activations: {e}") from None


# ---- per-module overrides (GPTQModel's `dynamic`) -------------------------------------------------

# Keys of a `dynamic` rule's value that pdserve honours (others are refused, not silently ignored).
OVERRIDE_KEYS = ("bits", "group_size", "sym", "desc_act")
# The mixed formats' rules for the attention projections (module names such as
# model.layers.3.self_attn.q_proj; vLLM matches its fused model.layers.3.self_attn.qkv_proj too).
ATTENTION_PATTERN = r".*\.self_attn\..*"


def attention_rules(bits: int) -> dict[str, dict]:
    """GPTQModel `dynamic` rules for `--attention-bits`: 16 leaves attention unquantized (a negative
    rule), 8 makes it INT8 per output channel, symmetric."""
    if bits == 16:
        return {f"-:{ATTENTION_PATTERN}": {}}
    if bits == 8:
        return {f"+:{ATTENTION_PATTERN}": {"bits": 8, "group_size": -1, "sym": True, "desc_act": False}}
    raise QuantError(f"unsupported attention bits {bits} (supported: 8, 16)")


def match_dynamic(rules: dict[str, dict], module: str) -> dict | None:
    """GPTQModel's matching, as vLLM implements it: the first rule (in file order) whose regex
    re.match-es the module name decides; "-:" means not quantized (None), "+:" or no prefix gives
    the overrides ({} when no rule matches: the base config)."""
    import re

    for pattern, overrides in rules.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], module):
                return None
        elif re.match(pattern.removeprefix("+:"), module):
            return overrides
    return {}


def check_dynamic(rules: object) -> dict[str, dict]:
    """A `dynamic` field we can honour: regex keys, override objects with known keys only."""
    import re

    if not isinstance(rules, dict):
        raise QuantError(f"quantization_config.dynamic must be an object of regex -> overrides, got {rules!r}")
    for pattern, overrides in rules.items():
        try:
            re.compile(pattern[2:] if pattern[:2] in ("+:", "-:") else pattern)
        except re.error as e:
            raise QuantError(f"quantization_config.dynamic: bad regex {pattern!r} ({e})") from None
        unknown = set(overrides) - set(OVERRIDE_KEYS) if isinstance(overrides, dict) else {"<not an object>"}
        if unknown:
            raise QuantError(f"quantization_config.dynamic[{pattern!r}]: unsupported override "
                             f"{', '.join(sorted(unknown))} (supported: {', '.join(OVERRIDE_KEYS)})")
    return rules


def spec_for_module(base: QuantSpec, rules: dict[str, dict] | None, module: str) -> QuantSpec | None:
    """The spec `module` is quantized with under `rules` (None: left unquantized)."""
    overrides = match_dynamic(rules, module) if rules else {}
    if overrides is None:
        return None
    if not overrides:
        return base
    return QuantSpec(bits=int(overrides.get("bits", base.bits)),
                     group_size=int(overrides.get("group_size", base.group_size)),
                     sym=bool(overrides.get("sym", base.sym)), desc_act=bool(overrides.get("desc_act", base.desc_act)))
