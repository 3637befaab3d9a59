"""Quantizing a whole model: decoder layer by decoder layer, in the order the data flows.

For GPTQ each layer sees the calibration activations that the already-quantized layers before it
produce, and inside a layer the projections go in stages, one per fused matmul of the architecture
spec (`config.arch.sites`: q/k/v, o, gate/up, down): each stage records the Hessian of its inputs
with the earlier stages already quantized ("true sequential"), so later projections compensate for
the error of earlier ones. RTN needs no data and just rounds.

The calibration forward is the serving model's own `runtime.model.DecoderLayer`, run by
`dense_forward` with plain causal attention over whole sequences instead of the paged cache.

The formats, each built by one function from a weight dict:
    quantize_model(config, weights, spec, method, calib)              weight-only (RTN / GPTQ)
    quantize_model(..., rules=attention_rules(8 | 16))                mixed: INT4 MLP, INT8 / dense attention
    quantize_w8a8(config, weights, ActSpec("dynamic"))                W8A8, activations per token at run time
    quantize_w8a8(config, weights, ActSpec("static", "minmax"), calib)  W8A8, calibrated activation scales
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from pdserve.quant.gptq import HessianAccumulator, gptq_quantize
from pdserve.quant.gptq_format import QuantizedWeight, module_name
from pdserve.quant.int8_act import DYNAMIC, Int8ActWeight, ObservedLinear, make_observer
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import ActSpec, QuantError, QuantSpec, spec_for_module
from pdserve.runtime.arch import LLAMA, LinearSite
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.kernels import torch_ops
from pdserve.runtime.model import DecoderLayer, build_layer, dense_forward, layer_context, site_linear

# The stages of every supported architecture (they share the Llama layout): `pdserve quantize`
# sizes its progress bar with them.
STAGES: tuple[LinearSite, ...] = LLAMA.sites
Progress = Callable[[str], None]  # called once per finished stage with a label


class _Reached(Exception):
    """Raised by a _Recorder once it has its inputs: the rest of the layer's forward is not needed."""


class _Recorder:
    """A linear that accumulates the Hessian of its inputs, then cuts the forward short."""

    def __init__(self, in_features: int) -> None:
        self.acc = HessianAccumulator(in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.acc.add(x)
        raise _Reached


def quantize_model(config: ModelConfig, weights: dict[str, torch.Tensor], spec: QuantSpec, method: str,
                   calib_ids: torch.Tensor | None = None, damp_percent: float = 0.01,
                   progress: Progress | None = None, batch: int = 16, rules: dict[str, dict] | None = None) -> dict:
    """The weight dict with every decoder projection replaced by a QuantizedWeight.

    calib_ids: [n, T] token ids (GPTQ only). Embeddings, norms and lm_head stay as they are.
    rules: GPTQModel `dynamic` overrides by module name (`spec.attention_rules`); a projection they
    leave unquantized stays a dense tensor (and later GPTQ stages calibrate against it as such).
    """
    if method == "gptq" and calib_ids is None:
        raise QuantError("GPTQ needs calibration data")
    if method == "rtn" and spec.desc_act:
        raise QuantError("activation order (desc_act) only applies to GPTQ")
    arch, out, ctx = config.arch, dict(weights), layer_context(config, torch_ops)
    x = None  # [n, T, D] calibration hidden states entering the current layer
    if method == "gptq":
        x = F.embedding(calib_ids, weights[arch.global_name("embed")].float())

    def quantize(w: torch.Tensor, h: torch.Tensor | None, s: QuantSpec) -> QuantizedWeight:
        """w: [out, in]; h: the Hessian of its site's inputs, None for RTN."""
        result = gptq_quantize(w, h, s, damp_percent) if h is not None else rtn_quantize(w, s)
        return QuantizedWeight.from_result(result, s.bits)

    for i in range(config.num_layers):
        lw = {n: weights[n].float() for n in arch.layer_names(config, i)}  # calibration runs in fp32
        layer = build_layer(config, lw, i, ctx)
        for site in arch.sites:
            specs = {r: spec_for_module(spec, rules, module_name(arch.layer_name(i, r))) for r in site.weights}
            if all(s is None for s in specs.values()):  # left unquantized: nothing to calibrate
                if progress:
                    progress(f"layer {i} {site.name}")
                continue
            h = _site_hessian(layer, site, arch.site_in_features(site, config), x, batch) if x is not None else None
            for role, s in specs.items():
                name = arch.layer_name(i, role)
                if s is not None:
                    out[name] = lw[name] = quantize(lw[name], h, s)
            layer = replace(layer, **{site.name: site_linear(config, lw, i, site)})  # later stages see it quantized
            if progress:
                progress(f"layer {i} {site.name}")
        if x is not None:  # the next layer calibrates on what the quantized layer produces
            with torch.inference_mode():
                x = torch.cat([dense_forward(layer, x[j:j + batch]) for j in range(0, len(x), batch)])
    return out


@torch.inference_mode()
def _site_hessian(layer: DecoderLayer, site: LinearSite, in_features: int, x: torch.Tensor,
                  batch: int) -> torch.Tensor:
    """H of the inputs reaching `site`, with the stages before it already quantized."""
    rec = _Recorder(in_features)
    tapped = replace(layer, **{site.name: rec})
    for j in range(0, len(x), batch):
        try:
            dense_forward(tapped, x[j:j + batch])
        except _Reached:
            pass
    return rec.acc.hessian()


W8A8_WEIGHTS = QuantSpec(8, -1, sym=True)  # W8A8's weights: INT8 per output channel, symmetric, RTN


def quantize_w8a8(config: ModelConfig, weights: dict[str, torch.Tensor], act: ActSpec,
                  calib_ids: torch.Tensor | None = None, progress: Progress | None = None, batch: int = 16) -> dict:
    """The weight dict with every decoder projection an `Int8ActWeight`: INT8 weights (RTN, per
    output channel, symmetric) and INT8 activations as `act` says.

    dynamic: no data needed. static: each site's input range is observed over calib_ids ([n, T]),
    layer by layer, each layer seeing what the already-quantized layers before it produce (inside a
    layer the sites are observed in one float pass). q/k/v (and gate/up) share one observer: one
    input, hence one scale, so they stay one fused integer matmul.
    """
    static = act.scheme == "static"
    if static and calib_ids is None:
        raise QuantError("static activation scales need calibration data")
    arch, out, ctx = config.arch, dict(weights), layer_context(config, torch_ops)
    x = F.embedding(calib_ids, weights[arch.global_name("embed")].float()) if static else None  # [n, T, D]
    for i in range(config.num_layers):
        lw = {n: weights[n].float() for n in arch.layer_names(config, i)}
        acts = _observe_layer(build_layer(config, lw, i, ctx), arch.sites, act, x, batch) if static else {}
        for site in arch.sites:
            for role in site.weights:
                name = arch.layer_name(i, role)
                qw = QuantizedWeight.from_result(rtn_quantize(lw[name], W8A8_WEIGHTS), 8)
                out[name] = lw[name] = Int8ActWeight(qw, acts.get(site.name, DYNAMIC))
            if progress:
                progress(f"layer {i} {site.name}")
        if static:  # the next layer is calibrated on this layer's quantized output
            layer = build_layer(config, lw, i, ctx)
            with torch.inference_mode():
                x = torch.cat([dense_forward(layer, x[j:j + batch]) for j in range(0, len(x), batch)])
    return out


@torch.inference_mode()
def _observe_layer(layer: DecoderLayer, sites: tuple[LinearSite, ...], act: ActSpec, x: torch.Tensor,
                   batch: int) -> dict:
    """Each site's static activation quantization, from its inputs over the calibration batch."""
    observers = {site.name: make_observer(act) for site in sites}
    tapped = replace(layer, **{s: ObservedLinear(getattr(layer, s), obs) for s, obs in observers.items()})
    for j in range(0, len(x), batch):
        dense_forward(tapped, x[j:j + batch])
    return {s: obs.params() for s, obs in observers.items()}
