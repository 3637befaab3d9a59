"""A GPTQ checkpoint's codes served by torch's CPU int4 kernel (`int4_cpu.Int4Linear`).

Why: `QuantLinear` dequantizes its whole weight on every call on the CPU, so a GPTQ INT4 model
decodes slower than a dense bf16 one; the int4 kernel reads the packed codes instead. The codes
are the checkpoint's own, converted exactly (`int4_codes`):

- GPTQ's w = (q - z) * s per (group, output) becomes the kernel's w = (q - 8) * scale + zero with
  scale = s and zero = (8 - z) * s, one (scale, zero) per 32 inputs: a group of 64 or 128 (or one
  per channel) is several 32-groups with the same values. Symmetric checkpoints (z = 8) have
  zero 0.
- 8-bit codes are two 4-bit planes (u = 16 h + l, as gguf_packed does for Q8_0): the high plane
  (h - 8) * 16 s with zero 0, the low one (l - 8) * s + (136 - z) * s.
- Act-order (desc_act) checkpoints scatter each group over the inputs (g_idx); a stable sort of
  g_idx makes every group a run of columns, the codes are stored in that order, and the layer
  multiplies x[:, perm] (Int4Codes.perm). q/k/v (and gate/up) share their g_idx, hence one
  permutation and one fused kernel call. down_proj's permutation needs no gather: it is folded
  into the output rows of gate and up (`fold_down_permutations`).

Rounding: the kernel takes scale and zero in the activation dtype. s is rounded to it first
(bf16 keeps 8 of fp16's 11 significant bits; fp16 keeps s exactly) and zero is computed from the
rounded s in fp32 (exact), then rounded once, so a weight differs from the checkpoint's
(q - z) * s by at most (|q - z| + |8 - z|) * s * 2^-8 in bf16 (the scale's and the zero's relative
rounding, 2^-8 each), by |8 - z| * s * 2^-11 in fp16; symmetric 4-bit weights (zero 0) only by
the scale's rounding. The dense QuantLinear in bf16 rounds the same scale and then each product
((q - z) * s to 2^-8), so the two are within a few bf16 ulps of each other. Asymmetric 8-bit
zeros (|136 - z| up to 135) round by up to about half a step in bf16, as large as the dense
product's rounding of the group's largest weights; symmetric ones (z = 128: zero 8 s) are exact.

A layout the kernel cannot take (groups that are not whole runs of 32 inputs, e.g. group size 48;
inputs not a multiple of 32, outputs not one of 16: `int4_codes.shape_problem`) stays a QuantLinear, with a log line; `--weight-format int4`
(every projection 4-bit) re-quantizes such weights, and 8-bit ones, by round-to-nearest over
groups of 32 as it does a GGUF's non-4-bit tensors, and refuses shapes the kernel cannot take.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.int4_codes import GROUP, Int4Codes, quantize_rtn, shape_problem

log = logging.getLogger(__name__)

PACKABLE_BITS = (4, 8)  # 8: as two planes
MLP_ROLES = ("gate", "up", "down")  # down(silu(gate x) * up x): every ArchSpec's MLP (runtime.model)


def has_gptq_weights(weights: dict, config) -> bool:
    """Whether any of the decoder's projections in `weights` is a GPTQ QuantizedWeight."""
    return any(isinstance(weights.get(n), QuantizedWeight) for n in config.arch.projection_names(config))


def column_order(g_idx: torch.Tensor) -> torch.Tensor | None:
    """[K] int64: the input columns sorted by group (stable: in order within a group), or None where
    they are in order already (no activation order)."""
    perm = torch.sort(g_idx.long(), stable=True).indices
    return None if torch.equal(perm, torch.arange(len(perm))) else perm


def layout_problem(w: QuantizedWeight) -> str | None:
    """Why `w` cannot be the int4 kernel's codes exactly, or None when it can."""
    if w.bits not in PACKABLE_BITS:
        return f"{w.bits}-bit codes"
    shape = shape_problem(w.out_features, w.in_features)
    if shape is not None:
        return shape
    g = torch.sort(w.g_idx.long(), stable=True).values.view(-1, GROUP)  # [K / 32, 32] sorted groups
    if not bool((g == g[:, :1]).all()):
        return f"groups not whole runs of {GROUP} inputs"
    return None


def int4_codes(w: QuantizedWeight, act_dtype: torch.dtype) -> Int4Codes:
    """The kernel's codes of `w` (layout_problem(w) None), for activations in `act_dtype`."""
    perm = column_order(w.g_idx)
    codes = w.codes()  # [N, K] int32
    g = w.g_idx.long()
    if perm is not None:
        codes, g = codes[:, perm], g[perm]
    blocks = g[::GROUP]  # [K / 32]: the group of each run of 32 (sorted) columns
    s = w.scales.to(act_dtype).float()[blocks].t()  # [N, K / 32], as the kernel will hold it
    z = w.zeros()[blocks].t().float()  # [N, K / 32] integers
    if w.bits == 4:
        return Int4Codes(codes.to(torch.uint8), s, (8 - z) * s, act_dtype, perm=perm)
    u = codes.to(torch.uint8)
    return Int4Codes(torch.cat([u >> 4, u & 0x0F], dim=1), torch.cat([16 * s, s], dim=1),
                     torch.cat([torch.zeros_like(s), (136 - z) * s], dim=1), act_dtype, planes=2, perm=perm)


def _rtn(name: str, w, act_dtype: torch.dtype) -> Int4Codes:
    """Round-to-nearest 4-bit codes of a projection the kernel cannot take as it is (int4 asked)."""
    from pdserve.runtime.config import ConfigError

    dense = w.dequantize() if isinstance(w, QuantizedWeight) else w  # [N, K]
    shape = shape_problem(*dense.shape)
    if shape is not None:
        raise ConfigError(f"--weight-format int4: {name} has {shape}: serve it with --weight-format auto or dense")
    return quantize_rtn(dense).for_dtype(act_dtype)


def _why(w) -> str:
    if isinstance(w, QuantizedWeight):
        return layout_problem(w) or f"{w.bits}-bit codes"
    return "float" if isinstance(w, torch.Tensor) else type(w).__name__


def gptq_weights(weights: dict, config, act_dtype: torch.dtype, fmt: str) -> tuple[dict, str]:
    """(`weights` with the GPTQ projections the kernel takes as Int4Codes, the format).

    fmt "auto" / "packed": 4- and 8-bit codes converted, the rest kept as loaded (QuantLinear,
    float), logged; auto stays "dense" where nothing converts, and is "int4" where every projection
    is one 4-bit plane. "int4": 4-bit codes converted, every other projection re-quantized to 4 bits
    (round-to-nearest, logged)."""
    names = config.arch.projection_names(config)
    out, kept = dict(weights), {}
    for name in names:
        w = weights[name]
        ok = isinstance(w, QuantizedWeight) and layout_problem(w) is None and (fmt != "int4" or w.bits == 4)
        if ok:
            out[name] = int4_codes(w, act_dtype)
            continue
        kept[name] = _why(w)
        if fmt == "int4":
            out[name] = _rtn(name, w, act_dtype)
    out = fold_down_permutations(out, config)
    if fmt == "auto" and len(kept) == len(names):
        _log_kept(kept, len(names), "auto", "stay as loaded")
        return weights, "dense"
    if fmt == "auto":
        one_plane = not kept and all(out[n].planes == 1 for n in names)
        fmt = "int4" if one_plane else "packed"
    _log_kept(kept, len(names), fmt, "are re-quantized to 4 bits (round-to-nearest)" if fmt == "int4"
              else "stay as loaded")
    return out, fmt


def fold_down_permutations(weights: dict, config) -> dict:
    """`weights` with each act-order down_proj's input permutation moved into the rows of its layer's
    gate and up projections (where all three are Int4Codes): down's input is silu(gate x) * up x,
    elementwise, so permuting gate's and up's outputs permutes it, and down multiplies it as it
    comes. The widest of a layer's four input gathers (K = intermediate size) is gone."""
    arch, out = config.arch, dict(weights)
    for i in range(config.num_layers):
        gate, up, down = (arch.layer_name(i, role) for role in MLP_ROLES)
        g, u, d = out[gate], out[up], out[down]
        if not all(isinstance(w, Int4Codes) for w in (g, u, d)) or d.perm is None:
            continue
        out[gate], out[up], out[down] = g.rows(d.perm), u.rows(d.perm), replace(d, perm=None)
    return out


def _log_kept(kept: dict[str, str], total: int, fmt: str, what: str) -> None:
    if kept:
        log.info("weight format %s: %d of %d GPTQ projections %s, not the int4 kernel's codes as they are (%s)",
                 fmt, len(kept), total, what, "; ".join(sorted(set(kept.values()))))
