"""W8A8: INT8 weights (per output channel, symmetric) times INT8 activations, in an integer matmul.

Weights are GPTQ-format INT8 codes with zero point 128 (`QuantizedWeight`, bits 8, one group), held
at run time as signed int8 wq = code - 128 in [-127, 127] with a scale sw per output channel.
Activations are quantized on each call (`ActSpec`, pdserve.quant.spec):

    dynamic  per token: sx[n] = max_i |x[n, i]| / 127, qx = round(x / sx) in [-127, 127]
             y[n, o] = sx[n] * sw[o] * sum_i qx[n, i] wq[o, i]
    static   per projection input, asymmetric, fixed at calibration: x ~ sx * (qx - zp),
             qx = clamp(round(x / sx) + zp, -128, 127)
             y[n, o] = sx * sw[o] * (sum_i qx[n, i] wq[o, i] - zp * sum_i wq[o, i])

The sum is torch._int_mm (int8 x int8 -> int32; on the CPU any shape, on CUDA more than 16 rows and
dimensions that are multiples of 8). It won at every row count measured on SmolLM2's shapes
(docs/quantization-activations.md, `python -m pdserve.quant.int8_bench`): oneDNN's
qlinear_pointwise computes the same numbers more slowly, fbgemm's linear_dynamic is faster but
quantizes activations per tensor with 7-bit range (another format), and dequantizing to fp32/bf16
then matmul costs a full weight pass per call.

`Int8ActWeight` is what sits in a checkpoint's weight dict for such a projection (weight + activation
parameters); `W8A8Linear` is the linear the model calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.spec import ActSpec, QuantError

QMIN, QMAX = -128, 127
_TINY = 1e-12  # floor of a scale, so that an all-zero row quantizes to zeros instead of NaN


@dataclass(frozen=True, slots=True, eq=False)
class ActQuant:
    """One projection input's activation quantization: dynamic (no tensors) or static (scale, zero point)."""

    scheme: str  # "dynamic" | "static"
    scale: torch.Tensor | None = None  # [1] float32, static only
    zero_point: torch.Tensor | None = None  # [1] int32 in [-128, 127], static only

    def same_as(self, other: ActQuant) -> bool:
        if self.scheme != other.scheme:
            return False
        return self.scheme == "dynamic" or (torch.equal(self.scale, other.scale)
                                            and torch.equal(self.zero_point, other.zero_point))

    def to(self, device: str | torch.device) -> ActQuant:
        if self.scheme == "dynamic":
            return self
        return replace(self, scale=self.scale.to(device), zero_point=self.zero_point.to(device))


DYNAMIC = ActQuant("dynamic")


def static_params(lo: float, hi: float) -> ActQuant:
    """Asymmetric INT8 over [lo, hi] widened to include 0 (so that 0 is exact): scale = range / 255,
    zero point = -128 - round(lo / scale), in [-128, 127]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max((hi - lo) / (QMAX - QMIN), _TINY)
    zp = int(min(max(QMIN - round(lo / scale), QMIN), QMAX))
    return ActQuant("static", torch.tensor([scale], dtype=torch.float32), torch.tensor([zp], dtype=torch.int32))


def quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, K] float -> (codes [N, K] int8 in [-127, 127], scales [N, 1] float32)."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=_TINY) / 127.0
    return torch.round(x / scale).to(torch.int8), scale  # |x / scale| <= 127: no clamp needed


def quantize_static(x: torch.Tensor, act: ActQuant) -> torch.Tensor:
    """x: [N, K] float -> codes [N, K] int8 with the calibrated scale and zero point (clamped)."""
    return (torch.round(x.float() / act.scale) + act.zero_point).clamp(QMIN, QMAX).to(torch.int8)


def int8_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a: [N, K] int8, w: [M, K] int8 -> a @ w.T [N, M] int32, exactly.

    torch._int_mm reads w.T as a transposed view (faster than a contiguous [K, M] copy at most
    measured shapes). On CUDA, shapes it refuses go through fp32, exact while |sum| < 2**24."""
    if a.is_cuda and not (a.shape[0] > 16 and a.shape[1] % 8 == 0 and w.shape[0] % 8 == 0):
        return torch.matmul(a.float(), w.float().t()).round().to(torch.int32)
    return torch._int_mm(a, w.t())


@dataclass(frozen=True, slots=True, eq=False)
class Int8ActWeight:
    """A W8A8 projection in a checkpoint's weight dict: its INT8 GPTQ weight and its activation
    quantization. Has `shape` and `to(device)` like the tensors beside it."""

    weight: QuantizedWeight  # bits 8, one group per output channel, symmetric (zero 128)
    act: ActQuant

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        extra = 0 if self.act.scheme == "dynamic" else 8
        return self.weight.nbytes + extra

    def to(self, device: str | torch.device) -> Int8ActWeight:
        return Int8ActWeight(self.weight.to(device), self.act.to(device))

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (wq [out, in] int8 = code - 128, sw [out] float32)."""
        w = self.weight
        wq = (w.codes() - w.zeros()[0][:, None]).to(torch.int8)
        return wq.contiguous(), w.scales[0].float().contiguous()

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensors: the GPTQ ones, plus `name.input_scale` [1] float32 and
        `name.input_zero_point` [1] int32 for static activations."""
        out = self.weight.tensors(name)
        if self.act.scheme == "static":
            # Copies: fused projections share one ActQuant, and safetensors refuses shared storage.
            out |= {f"{name}.input_scale": self.act.scale.clone(),
                    f"{name}.input_zero_point": self.act.zero_point.clone()}
        return out


class W8A8Linear:
    """y = dequant(int8(x) @ int8(W)^T) + b: activations quantized per call, an integer matmul."""

    __slots__ = ("wq", "sw", "act", "zp_corr", "out_scale", "bias", "in_features", "out_features")

    def __init__(self, wq: torch.Tensor, sw: torch.Tensor, act: ActQuant, bias: torch.Tensor | None = None) -> None:
        self.wq = wq  # [out, in] int8
        self.sw = sw  # [out] float32
        self.act = act
        self.bias = bias
        self.out_features, self.in_features = wq.shape
        static = act.scheme == "static"
        # Static only: the zero-point correction zp * sum_i wq[o, i] [out] int32, and sx * sw [out].
        self.zp_corr = act.zero_point * wq.sum(dim=1, dtype=torch.int32) if static else None
        self.out_scale = act.scale * sw if static else None

    @classmethod
    def of(cls, weights: Sequence[Int8ActWeight], bias: torch.Tensor | None = None) -> W8A8Linear:
        """One linear over projections that share their input's quantization, concatenated along outputs."""
        parts = [w.int8_weight() for w in weights]
        return cls(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), weights[0].act, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)  # [N, in]
        # In-place epilogues: each [N, out] temporary is a fresh allocation, and at prefill sizes
        # (MBs) its page faults cost more than the matmul on this VM (docs/quantization-activations.md).
        if self.act.scheme == "dynamic":
            qx, sx = quantize_dynamic(x2)
            y = int8_matmul(qx, self.wq).float().mul_(sx).mul_(self.sw)  # [N, out]
        else:
            qx = quantize_static(x2, self.act)
            y = int8_matmul(qx, self.wq).sub_(self.zp_corr).float().mul_(self.out_scale)  # [N, out]
        y = y.to(x.dtype).view(*lead, self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        ts = [self.wq, self.sw] + [t for t in (self.zp_corr, self.out_scale, self.bias, self.act.scale, self.act.zero_point)
                                   if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


def fusable(weights: Sequence[object]) -> bool:
    """Whether W8A8 projections can run as one matmul: they share the input's quantization."""
    first = weights[0]
    return all(isinstance(w, Int8ActWeight) and w.act.same_as(first.act) for w in weights)


# ---- observers (static calibration) ---------------------------------------------------------------

class MinMaxObserver:
    """The range of every value seen."""

    def __init__(self) -> None:
        self.lo, self.hi = float("inf"), float("-inf")

    def add(self, x: torch.Tensor) -> None:
        self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))

    def params(self) -> ActQuant:
        return static_params(self.lo, self.hi)


class PercentileObserver:
    """The p-th and (100 - p)-th percentiles of every value seen: the smallest value v with at least
    q % of the values <= v (numpy's "inverted_cdf" percentile). Exact: the values are kept, then
    selected with kthvalue (torch.quantile refuses inputs of more than 2**24 values)."""

    def __init__(self, percentile: float) -> None:
        self.percentile = percentile
        self.seen: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        self.seen.append(x.detach().float().reshape(-1).clone())

    def params(self) -> ActQuant:
        if not self.seen:
            raise QuantError("no calibration activations were observed")
        v = torch.cat(self.seen)
        n = v.numel()
        lo, hi = (float(v.kthvalue(_rank(n, q)).values) for q in (100.0 - self.percentile, self.percentile))
        return static_params(lo, hi)


def _rank(n: int, q: float) -> int:
    """The 1-based rank of the q-th percentile of n values (inverted CDF)."""
    return min(max(math.ceil(n * q / 100.0 - 1e-9), 1), n)


def make_observer(spec: ActSpec) -> MinMaxObserver | PercentileObserver:
    return PercentileObserver(spec.percentile) if spec.observer == "percentile" else MinMaxObserver()


class ObservedLinear:
    """A linear that shows its inputs to an observer, then computes as before (calibration only)."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor],
                 observer: MinMaxObserver | PercentileObserver) -> None:
        self.inner, self.observer = inner, observer
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.observer.add(x)
        return self.inner(x)


# ---- loading --------------------------------------------------------------------------------------

def read_act_weight(name: str, weight: QuantizedWeight, tensors: dict[str, torch.Tensor],
                    spec: ActSpec) -> Int8ActWeight:
    """Projection `name`'s activation parameters from the checkpoint tensors, checked."""
    if weight.bits != 8 or weight.scales.shape[0] != 1:
        raise QuantError(f"{name}: activation quantization needs INT8 weights with one group per output "
                         f"channel (bits=8, group_size=-1), got bits={weight.bits} with "
                         f"{weight.scales.shape[0]} groups")
    if not bool((weight.zeros() == 128).all()):
        raise QuantError(f"{name}: activation quantization needs symmetric INT8 weights (zero point 128)")
    if spec.scheme == "dynamic":
        return Int8ActWeight(weight, DYNAMIC)
    scale, zp = (_act_tensor(name, part, tensors) for part in ("input_scale", "input_zero_point"))
    if zp.is_floating_point() or scale.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantError(f"{name}: input_scale must be float and input_zero_point integer, got "
                         f"{scale.dtype} and {zp.dtype}")
    if not (bool(torch.isfinite(scale).all()) and float(scale) > 0):
        raise QuantError(f"tensor {name}.input_scale is {float(scale)}, expected a positive finite scale")
    if not QMIN <= int(zp) <= QMAX:
        raise QuantError(f"tensor {name}.input_zero_point is {int(zp)}, expected -128..127 (signed INT8 codes)")
    return Int8ActWeight(weight, ActQuant("static", scale.float().reshape(1), zp.to(torch.int32).reshape(1)))


def _act_tensor(name: str, part: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    t = tensors.get(f"{name}.{part}")
    if t is None:
        raise QuantError(f"missing tensor {name}.{part} (quantization_config.pdserve.activations is static)")
    if t.numel() != 1 or t.dim() > 1:
        raise QuantError(f"tensor {name}.{part} has shape {tuple(t.shape)}, expected (1,) "
                         "(one value per projection input)")
    return t
