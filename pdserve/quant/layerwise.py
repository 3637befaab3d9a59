"""Quantizing a whole model: decoder layer by decoder layer, in the order the data flows.

For GPTQ each layer sees the calibration activations that the already-quantized layers before it
produce, and inside a layer the projections go in stages, one per fused matmul of the architecture
spec (`config.arch.sites`: q/k/v, o, gate/up, down): each stage records the Hessian of its inputs
with the earlier stages already quantized ("true sequential"), so later projections compensate for
the error of earlier ones. RTN needs no data and just rounds.

The calibration forward is the serving model's own `runtime.model.DecoderLayer`, run by
`dense_forward` with plain causal attention over whole sequences instead of the paged cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from pdserve.quant.gptq import HessianAccumulator, gptq_quantize
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import QuantError, QuantSpec
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
                   progress: Progress | None = None, batch: int = 16) -> dict:
    """The weight dict with every decoder projection replaced by a QuantizedWeight.

    calib_ids: [n, T] token ids (GPTQ only). Embeddings, norms and lm_head stay as they are.
    """
    if method == "gptq" and calib_ids is None:
        raise QuantError("GPTQ needs calibration data")
    if method == "rtn" and spec.desc_act:
        raise QuantError("activation order (desc_act) only applies to GPTQ")
    arch, out, ctx = config.arch, dict(weights), layer_context(config, torch_ops)
    x = None  # [n, T, D] calibration hidden states entering the current layer
    if method == "gptq":
        x = F.embedding(calib_ids, weights[arch.global_name("embed")].float())

    def quantize(w: torch.Tensor, h: torch.Tensor | None) -> QuantizedWeight:
        """w: [out, in]; h: the Hessian of its site's inputs, None for RTN."""
        result = gptq_quantize(w, h, spec, damp_percent) if h is not None else rtn_quantize(w, spec)
        return QuantizedWeight.from_result(result, spec.bits)

    for i in range(config.num_layers):
        lw = {n: weights[n].float() for n in arch.layer_names(config, i)}  # calibration runs in fp32
        layer = build_layer(config, lw, i, ctx)
        for site in arch.sites:
            h = _site_hessian(layer, site, arch.site_in_features(site, config), x, batch) if x is not None else None
            for role in site.weights:
                name = arch.layer_name(i, role)
                out[name] = lw[name] = quantize(lw[name], h)
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
