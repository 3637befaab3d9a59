"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel) and `QuantizedWeight`, one quantized projection.

Per quantized linear layer `<name>` (e.g. model.layers.0.self_attn.q_proj), with P = 32 / bits:

    <name>.qweight  int32 [ceil(in / P), out]   codes packed along the input dim (see `packing`)
    <name>.qzeros   int32 [groups, ceil(out / P)] zero points packed along the output dim
    <name>.scales   float16 [groups, out]
    <name>.g_idx    int32 [in]                  group of each input channel (activation order)
    <name>.bias     float16 [out]               optional

    w[o, i] = scales[g_idx[i], o] * (code[i, o] - (zero[g_idx[i], o] + offset))

offset = 1 in the classic "gptq" format (the stored zero is zero - 1, a historical quirk kept for
compatibility), 0 in GPTQModel's "gptq_v2". The config (config.json `quantization_config`, else
quantize_config.json) gives bits, group_size (-1: one group), desc_act, sym, checkpoint_format, and
optionally GPTQModel's per-module `dynamic` overrides ("regex": {bits, group_size, ...}; a "-:"
rule leaves the module unquantized, stored as a dense `.weight`).

pdserve's extension, W8A8 (docs/quantization-activations.md): `quantization_config.pdserve.activations`
({"scheme": "dynamic" | "static", ...}) says the INT8 projections also quantize their inputs; static
ones carry `<name>.input_scale` (float32 [1]) and `<name>.input_zero_point` (int32 [1]). Other GPTQ
loaders ignore both and run the same weights as W8A16.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.quant.packing import pack_cols, pack_rows, per_word, unpack_cols, unpack_rows
from pdserve.quant.quantizer import QuantResult
from pdserve.quant.spec import SUPPORTED_BITS, ActSpec, QuantError, check_dynamic, match_dynamic

if TYPE_CHECKING:
    from pdserve.runtime.config import ModelConfig

# checkpoint_format -> offset added to the stored zero points.
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
PARTS = ("qweight", "qzeros", "scales", "g_idx")  # the tensors of one quantized linear, after "<name>."
ACT_PARTS = ("input_scale", "input_zero_point")  # a static W8A8 linear's activation parameters
QUANT_CONFIG_FILE = "quantize_config.json"


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """The quantization_config of a checkpoint, as far as loading needs it."""

    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool
    sym: bool
    checkpoint_format: str
    raw: dict[str, Any]  # everything the file said, provenance included
    dynamic: dict[str, dict] | None = None  # GPTQModel's per-module overrides, regex -> fields
    activations: ActSpec | None = None  # pdserve's W8A8 extension: how inputs are quantized

    @property
    def zero_offset(self) -> int:
        return ZERO_OFFSETS[self.checkpoint_format]

    def for_module(self, module: str) -> QuantConfig | None:
        """This module's config under the `dynamic` rules; None when a "-:" rule leaves it unquantized."""
        overrides = match_dynamic(self.dynamic, module) if self.dynamic else {}
        if overrides is None:
            return None
        if not overrides:
            return self
        bits, group = int(overrides.get("bits", self.bits)), int(overrides.get("group_size", self.group_size))
        if bits not in SUPPORTED_BITS:
            raise QuantError(f"unsupported GPTQ bits {bits} for {module} in quantization_config.dynamic")
        return replace(self, bits=bits, group_size=group, desc_act=bool(overrides.get("desc_act", self.desc_act)),
                       sym=bool(overrides.get("sym", self.sym)), dynamic=None)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)


def parse_quant_config(raw: dict[str, Any]) -> QuantConfig:
    method = raw.get("quant_method", "gptq")
    if method != "gptq":
        raise QuantError(f"unsupported quant_method {method!r} (only 'gptq' checkpoints are supported)")
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    if fmt not in ZERO_OFFSETS:
        raise QuantError(f"unsupported GPTQ checkpoint_format {fmt!r} (supported: {', '.join(ZERO_OFFSETS)})")
    try:
        bits, group_size = int(raw["bits"]), int(raw.get("group_size", -1))
    except KeyError as e:
        raise QuantError(f"quantization_config lacks {e.args[0]!r}") from None
    if bits not in SUPPORTED_BITS:
        raise QuantError(f"unsupported GPTQ bits {bits} (supported: {', '.join(map(str, SUPPORTED_BITS))})")
    if group_size != -1 and group_size <= 0:
        raise QuantError(f"invalid GPTQ group_size {group_size} (positive, or -1 for per-channel)")
    dynamic = check_dynamic(raw["dynamic"]) if raw.get("dynamic") else None
    pd = raw.get("pdserve")
    act = ActSpec.from_json(pd["activations"]) if isinstance(pd, dict) and pd.get("activations") else None
    return QuantConfig(bits, group_size, bool(raw.get("desc_act", False)), bool(raw.get("sym", True)), fmt, raw,
                       dynamic, act)


def read_quant_config(directory: Path, config_json: dict[str, Any]) -> QuantConfig | None:
    """The checkpoint's quantization config: config.json's quantization_config, else quantize_config.json."""
    raw = config_json.get("quantization_config")
    if raw is None and (directory / QUANT_CONFIG_FILE).exists():
        try:
            raw = json.loads((directory / QUANT_CONFIG_FILE).read_text())
        except (OSError, ValueError) as e:
            raise QuantError(f"{QUANT_CONFIG_FILE}: not valid JSON ({e})") from e
    return None if raw is None else parse_quant_config(raw)


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedWeight:
    """One quantized [out, in] weight in GPTQ layout; sits in a checkpoint's weight dict in place of
    the dense tensor (it has `shape` and `to(device)`), and the model turns it into a QuantLinear."""

    qweight: torch.Tensor  # int32 [ceil(in / P), out]
    qzeros: torch.Tensor  # int32 [groups, ceil(out / P)]
    scales: torch.Tensor  # [groups, out] float
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    zero_offset: int  # 1: classic gptq (stored zero = zero - 1); 0: gptq_v2
    in_features: int
    out_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales, self.g_idx))

    def to(self, device: str | torch.device) -> QuantizedWeight:
        return replace(self, qweight=self.qweight.to(device), qzeros=self.qzeros.to(device),
                       scales=self.scales.to(device), g_idx=self.g_idx.to(device))

    def codes(self) -> torch.Tensor:
        """-> [out, in] int32 codes."""
        return unpack_rows(self.qweight, self.bits, self.in_features).t()

    def zeros(self) -> torch.Tensor:
        """-> [groups, out] int32 zero points, offset applied."""
        return unpack_cols(self.qzeros, self.bits, self.out_features) + self.zero_offset

    def dequantize(self) -> torch.Tensor:
        """-> [out, in] in the scales' dtype."""
        g = self.g_idx.long()
        return ((self.codes() - self.zeros()[g].t()).to(self.scales.dtype) * self.scales[g].t())

    @classmethod
    def from_result(cls, result: QuantResult, bits: int) -> QuantizedWeight:
        """Packs a quantization result in the classic format (zero - 1 stored; zeros are >= 1)."""
        out, n = result.codes.shape
        return cls(qweight=pack_rows(result.codes.t(), bits), qzeros=pack_cols(result.zeros - 1, bits),
                   scales=result.scales.half().float(), g_idx=result.g_idx.to(torch.int32), bits=bits,
                   zero_offset=1, in_features=n, out_features=out)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of projection `name` (scales in float16, as GPTQ stores them)."""
        return {f"{name}.qweight": self.qweight, f"{name}.qzeros": self.qzeros,
                f"{name}.scales": self.scales.half(), f"{name}.g_idx": self.g_idx}


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], qc: QuantConfig) -> None:
    if tuple(tensor.shape) != shape:
        raise QuantError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {shape} for bits={qc.bits}, "
                         f"group_size={qc.group_size} (the quantization config and the tensors disagree)")


def build_quantized_weight(name: str, tensors: dict[str, torch.Tensor], out: int, n: int, qc: QuantConfig,
                           dtype: torch.dtype) -> QuantizedWeight:
    """Checks one projection's GPTQ tensors against the model and quantization configs."""
    p, groups = per_word(qc.bits), qc.groups(n)
    for part in ("qweight", "qzeros", "scales"):
        if f"{name}.{part}" not in tensors:
            raise QuantError(f"missing tensor {name}.{part}")
    qweight, qzeros, scales = (tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales"))
    _check_shape(f"{name}.qweight", qweight, (-(-n // p), out), qc)
    _check_shape(f"{name}.qzeros", qzeros, (groups, -(-out // p)), qc)
    _check_shape(f"{name}.scales", scales, (groups, out), qc)
    for part, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise QuantError(f"tensor {name}.{part} is {t.dtype}, expected torch.int32")
    g_idx = tensors.get(f"{name}.g_idx")
    if g_idx is None:  # some writers omit it without activation order: consecutive groups
        g_idx = torch.arange(n, dtype=torch.int32) // (n if qc.group_size == -1 else qc.group_size)
    _check_shape(f"{name}.g_idx", g_idx, (n,), qc)
    if n and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise QuantError(f"tensor {name}.g_idx has group indices outside 0..{groups - 1}")
    return QuantizedWeight(qweight.contiguous(), qzeros.contiguous(), scales.to(dtype).contiguous(),
                           g_idx.to(torch.int32).contiguous(), qc.bits, qc.zero_offset, n, out)


def module_name(weight_name: str) -> str:
    """GPTQ names a linear's tensors after its module: <module>.weight -> <module>.qweight, ..."""
    return weight_name.removesuffix(".weight")


def read_quantized_linears(files: list[Path], config: ModelConfig, qc: QuantConfig,
                           dtype: torch.dtype) -> dict[str, QuantizedWeight]:
    """Every projection stored as qweight/... -> QuantizedWeight under its HF `.weight` name
    (an `int8_act.Int8ActWeight` when the config quantizes activations too).

    The projections are the spec's quantizable linears (`config.arch`); those stored densely
    (`.weight`, e.g. left unquantized) are read by the dense path. Each module is read with its
    own config under the `dynamic` rules.
    """
    from safetensors import safe_open

    arch = config.arch
    names = arch.projection_names(config)
    head = f"{module_name(arch.global_name('lm_head'))}.qweight"
    wanted = {f"{module_name(n)}.{part}" for n in names for part in PARTS + ACT_PARTS}
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if head in st.keys():
                raise QuantError("a quantized lm_head is not supported (only the decoder layers' projections)")
            for key in wanted.intersection(st.keys()):
                tensors[key] = st.get_tensor(key)
    if not tensors:
        raise QuantError("the config says GPTQ but no tensor is quantized (no *.qweight): "
                         "the quantization config and the tensors disagree")
    shapes = arch.expected_shapes(config)
    out: dict[str, QuantizedWeight] = {}
    for name in names:
        module = module_name(name)
        if f"{module}.qweight" not in tensors:
            continue
        mqc = qc.for_module(module)
        if mqc is None:
            raise QuantError(f"tensor {module}.qweight is quantized but quantization_config.dynamic leaves "
                             f"{module} unquantized (a \"-:\" rule)")
        rows, cols = shapes[name]
        # W8A8 keeps its scales in fp32 whatever the load dtype (its epilogue runs in fp32).
        out[name] = build_quantized_weight(module, tensors, rows, cols, mqc,
                                           torch.float32 if qc.activations else dtype)
        if qc.activations is not None:
            from pdserve.quant.int8_act import read_act_weight  # noqa: PLC0415 (it imports this module)

            out[name] = read_act_weight(module, out[name], tensors, qc.activations)
    return out


def has_quantized_tensors(files: list[Path]) -> bool:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            if any(k.endswith(".qweight") for k in st.keys()):
                return True
    return False
