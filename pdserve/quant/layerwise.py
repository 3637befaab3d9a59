"""Quantizing a whole model: decoder layer by decoder layer, in the order the data flows.

For GPTQ each layer sees the calibration activations that the already-quantized layers before it
produce, and inside a layer the projections go in four stages (q/k/v, o, gate/up, down): each stage
records the Hessian of its inputs with the earlier stages already quantized ("true sequential"), so
later projections compensate for the error of earlier ones. RTN needs no data and just rounds.

The calibration forward below is a dense batched version of `runtime.model.LlamaModel` (same torch
kernels, causal SDPA instead of the paged cache): it only has to produce the projections' inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.quant.gptq import HessianAccumulator, gptq_quantize
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.linear import Linear, as_linear, fused_linear
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import QuantError, QuantSpec
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.kernels import torch_ops

# (site, projections fed by that site's input), in forward order.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("o", ("self_attn.o_proj",)),
    ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    ("down", ("mlp.down_proj",)),
)
Progress = Callable[[str], None]  # called once per finished stage with a label


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    linears: dict[str, Linear]  # site -> linear


class _Reached(Exception):
    """Raised by a _Recorder once it has its inputs: the rest of the layer's forward is not needed."""


class _Recorder:
    """A linear that accumulates the Hessian of its inputs, then cuts the forward short."""

    def __init__(self, inner: Linear, in_features: int) -> None:
        self.inner, self.out_features = inner, inner.out_features
        self.acc = HessianAccumulator(in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add(x)
        raise _Reached


def _layer_forward(layer: _Layer, x: torch.Tensor, c: ModelConfig, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D] hidden states entering the layer -> [B, T, D] leaving it."""
    b, t, d = x.shape
    hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
    h = torch_ops.rms_norm(x.reshape(-1, d), layer.input_norm, c.rms_norm_eps)
    q, k, v = layer.linears["qkv"](h).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    positions = torch.arange(t).repeat(b)
    q, k = torch_ops.apply_rope(q.reshape(-1, nh, hd), k.reshape(-1, nkv, hd), positions, cos, sin)
    attn = F.scaled_dot_product_attention(
        q.view(b, t, nh, hd).transpose(1, 2), k.view(b, t, nkv, hd).transpose(1, 2),
        v.reshape(b, t, nkv, hd).transpose(1, 2), is_causal=True, scale=1.0 / math.sqrt(hd),
        enable_gqa=True)  # [B, H, T, hd]
    x = x + layer.linears["o"](attn.transpose(1, 2).reshape(b * t, nh * hd)).view(b, t, d)
    h = torch_ops.rms_norm(x.reshape(-1, d), layer.post_norm, c.rms_norm_eps)
    return x + layer.linears["down"](torch_ops.silu_and_mul(layer.linears["gate_up"](h))).view(b, t, d)


def _in_features(c: ModelConfig, site: str) -> int:
    return {"qkv": c.hidden_size, "o": c.num_heads * c.head_dim, "gate_up": c.hidden_size,
            "down": c.intermediate_size}[site]


def _site_linear(w: dict, p: str, site: str, projections: tuple[str, ...], bias: bool) -> Linear:
    weights = [w[f"{p}{n}.weight"] for n in projections]
    biases = [w[f"{p}{n}.bias"] for n in projections] if bias and site == "qkv" else None
    return fused_linear(weights, biases) if len(weights) > 1 or biases else as_linear(weights[0])


def quantize_model(config: ModelConfig, weights: dict[str, torch.Tensor], spec: QuantSpec, method: str,
                   calib_ids: torch.Tensor | None = None, damp_percent: float = 0.01,
                   progress: Progress | None = None, batch: int = 16) -> dict:
    """The weight dict with every decoder projection replaced by a QuantizedWeight.

    calib_ids: [n, T] token ids (GPTQ only). Embeddings, norms and lm_head stay as they are.
    """
    if method == "gptq" and calib_ids is None:
        raise QuantError("GPTQ needs calibration data")
    if method == "rtn" and spec.desc_act:
        raise QuantError("activation order (desc_act) only applies to GPTQ")
    out = dict(weights)
    cos, sin = torch_ops.rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta)
    x = F.embedding(calib_ids, weights["model.embed_tokens.weight"].float()) if method == "gptq" else None
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = _Layer(weights[f"{p}input_layernorm.weight"].float(),
                       weights[f"{p}post_attention_layernorm.weight"].float(),
                       {s: _site_linear(weights, p, s, names, config.attention_bias) for s, names in STAGES})
        for site, names in STAGES:
            h = _site_hessian(layer, site, x, config, cos, sin, batch) if method == "gptq" else None
            for n in names:
                w = weights[f"{p}{n}.weight"].float()
                result = gptq_quantize(w, h, spec, damp_percent) if h is not None else rtn_quantize(w, spec)
                out[f"{p}{n}.weight"] = QuantizedWeight.from_result(result, spec.bits)
            layer.linears[site] = _site_linear(out, p, site, names, config.attention_bias)
            if progress:
                progress(f"layer {i} {site}")
        if x is not None:  # the next layer calibrates on what the quantized layer produces
            with torch.inference_mode():
                x = torch.cat([_layer_forward(layer, x[j:j + batch], config, cos, sin)
                               for j in range(0, len(x), batch)])
    return out


@torch.inference_mode()
def _site_hessian(layer: _Layer, site: str, x: torch.Tensor, c: ModelConfig, cos: torch.Tensor,
                  sin: torch.Tensor, batch: int) -> torch.Tensor:
    """H of the inputs reaching `site`, with the stages before it already quantized."""
    inner = layer.linears[site]
    rec = _Recorder(inner, _in_features(c, site))
    layer.linears[site] = rec
    try:
        for j in range(0, len(x), batch):
            try:
                _layer_forward(layer, x[j:j + batch], c, cos, sin)
            except _Reached:
                pass
    finally:
        layer.linears[site] = inner
    return rec.acc.hessian()
