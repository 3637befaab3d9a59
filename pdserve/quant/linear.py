"""The linear layers the runtime model calls: `layer.qkv(x)` etc., whatever the weight format.

- DenseLinear: F.linear on a float weight (the FP32 path, unchanged numerics).
- QuantLinear: a GPTQ-format weight dequantized on the fly in torch on each call (CPU, or any device
  torch runs on); memory stays packed (bits/8 bytes per weight plus scales and zeros). On a CUDA
  device with cupy, calls of up to `cuda_quant.MAX_ROWS` rows (decode) run the W8A16 / W4A16 kernel
  instead, which reads the packed words directly; more rows dequantize once and run a GEMM.
- Int4Linear (pdserve.quant.int4_cpu): 4-bit codes packed for torch's CPU int4 kernel
  (`--weight-format int4`), or 8-bit ones as two 4-bit planes (a GGUF's Q8_0 / Q5_K, gguf_packed);
  a GPTQ checkpoint's codes too, on the CPU in bf16/fp16 (gptq_cpu), instead of QuantLinear.
- W8A8Linear (pdserve.quant.int8_act): INT8 weights and INT8 activations (quantized per token, or
  with calibrated static scales) in an integer matmul.
- ConcatLinear: parts whose outputs are concatenated, for fused q/k/v or gate/up that cannot be
  merged into one matrix (different g_idx, or dense next to quantized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import functools

import torch
import torch.nn.functional as F

from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.int4_cpu import Int4Linear, same_inputs
from pdserve.quant.int4_codes import Int4Codes
from pdserve.quant.int8_act import Int8ActWeight, W8A8Linear, fusable
from pdserve.quant.packing import per_word


class Linear(Protocol):
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class DenseLinear:
    __slots__ = ("weight", "bias", "out_features")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + b


class QuantLinear:
    """y = x @ dequant(W)^T + b with W kept packed; zero points are unpacked once (they are small)."""

    __slots__ = ("qweight", "zeros", "scales", "g_idx", "bits", "in_features", "out_features", "bias", "_shifts",
                 "_kernel_args")

    def __init__(self, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        self.qweight = qweight  # int32 [ceil(in / P), out]
        self.zeros = zeros.to(scales.dtype)  # [groups, out], offset applied
        self.scales = scales  # [groups, out]
        self.g_idx = g_idx.long()  # [in]
        self.bits, self.in_features, self.out_features = bits, in_features, qweight.shape[1]
        self.bias = bias
        p = per_word(bits)
        self._shifts = (torch.arange(p, dtype=torch.int32, device=qweight.device) * bits).view(1, p, 1)
        self._kernel_args: tuple[torch.Tensor, ...] | None = None  # fp32 scales/zeros, int32 g_idx (GPU)

    @classmethod
    def of(cls, weights: Sequence[QuantizedWeight], bias: torch.Tensor | None = None) -> QuantLinear:
        """One QuantLinear over weights that share bits and g_idx, concatenated along output channels
        (qweight packs along inputs, so its columns concatenate as they are)."""
        first = weights[0]
        return cls(torch.cat([w.qweight for w in weights], dim=1), torch.cat([w.zeros() for w in weights], dim=1),
                   torch.cat([w.scales for w in weights], dim=1), first.g_idx, first.bits, first.in_features, bias)

    def weight_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight, transposed: [in, out] in `dtype`."""
        codes = (self.qweight.unsqueeze(1) >> self._shifts) & ((1 << self.bits) - 1)  # [W, P, out]
        codes = codes.view(-1, self.out_features)[:self.in_features]  # [in, out]
        return (codes.to(dtype) - self.zeros[self.g_idx].to(dtype)) * self.scales[self.g_idx].to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _cuda_quant_matmul() if x.is_cuda and x.dim() == 2 else None
        if kernel is not None and 0 < x.shape[0] <= kernel.MAX_ROWS and x.stride(-1) == 1:
            if self._kernel_args is None:
                self._kernel_args = (self.scales.float().contiguous(), self.zeros.float().contiguous(),
                                     self.g_idx.to(torch.int32).contiguous())
            y = kernel.quant_matmul(x, self.qweight.contiguous(), *self._kernel_args, self.bits)
        else:
            y = torch.matmul(x, self.weight_t(x.dtype))  # [N, out]
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        """Resident bytes (zeros are held unpacked, in the scales' dtype)."""
        ts = [self.qweight, self.scales, self.zeros, self.g_idx] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)


@functools.cache
def _cuda_quant_matmul():
    """The `cuda_quant` module when cupy works, else None (QuantLinear then stays on torch)."""
    try:
        from pdserve.runtime.kernels import cuda_quant  # noqa: PLC0415 (needs cupy)
    except ImportError:
        return None
    return cuda_quant


class ConcatLinear:
    __slots__ = ("parts", "out_features")

    def __init__(self, parts: Sequence[Linear]) -> None:
        self.parts = list(parts)
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def keep_dense_copy(self, int8_prompts: bool = False) -> None:
        for p in self.parts:
            keep_dense_copy(p, int8_prompts)

    @property
    def rows_split_by_kind(self) -> bool:
        """As Int4Linear's, where every part's is (one that says nothing: False)."""
        return all(getattr(p, "rows_split_by_kind", False) for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def keep_dense_copy(linear: Linear, int8_prompts: bool = False) -> None:
    """Lets a packed linear keep its dequantized weight for many-row calls (Int4Linear.keep_dense_copy);
    a no-op for formats that have no such path."""
    keep = getattr(linear, "keep_dense_copy", None)
    if keep is not None:
        keep(int8_prompts)


WeightLike = torch.Tensor | QuantizedWeight | Int4Codes | Int8ActWeight


def as_linear(weight: WeightLike, bias: torch.Tensor | None = None) -> Linear:
    if isinstance(weight, Int4Codes):
        return Int4Linear(weight, bias)
    if isinstance(weight, Int8ActWeight):
        return W8A8Linear.of([weight], bias)
    return QuantLinear.of([weight], bias) if isinstance(weight, QuantizedWeight) else DenseLinear(weight, bias)


def fused_linear(weights: Sequence[WeightLike], biases: Sequence[torch.Tensor] | None = None) -> Linear:
    """One linear computing the concatenation of each weight's output (q|k|v, gate|up).

    Dense weights are concatenated into one matrix (as before quantization existed). Quantized ones
    are concatenated along output channels when they share bits and g_idx, which q/k/v (and
    gate/up) do when quantized together: same inputs, same Hessian, same activation order (int4
    codes: the same input permutation, made from that g_idx); W8A8 ones when they share the input's
    quantization. Else each part runs on its own.
    """
    bias = torch.cat(list(biases)) if biases is not None else None
    if all(isinstance(w, torch.Tensor) for w in weights):
        return DenseLinear(torch.cat(list(weights), dim=0).contiguous(), bias)
    if all(isinstance(w, QuantizedWeight) for w in weights) and _same_layout(weights):
        return QuantLinear.of(weights, bias)
    if all(isinstance(w, Int4Codes) for w in weights) and same_inputs(weights):
        return Int4Linear.fused(weights, bias)
    if fusable(weights):  # W8A8 parts with one input quantization (q/k/v observe the same input)
        return W8A8Linear.of(weights, bias)
    parts = []
    for j, w in enumerate(weights):
        parts.append(as_linear(w, None if biases is None else biases[j]))
    return ConcatLinear(parts)


def _same_layout(weights: Sequence[QuantizedWeight]) -> bool:
    first = weights[0]
    return all(w.bits == first.bits and w.in_features == first.in_features
               and w.scales.shape[0] == first.scales.shape[0] and torch.equal(w.g_idx, first.g_idx)
               for w in weights)
