"""A 4-bit weight as codes (`Int4Codes`): what it is, and where its codes come from (the GGUF
file's own 4-bit tensors, round-to-nearest of a float weight), for the CPU's packed linears
(pdserve.quant.int4_cpu.Int4Linear, which multiplies them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pdserve.runtime.config import ConfigError

GROUP = 32  # llama.cpp's Q4 block, and a group size torch's kernel takes
ROW_MULTIPLE = 16  # torch's int4 packing takes output rows in multiples of 16


def shape_problem(out_features: int, in_features: int) -> str | None:
    """Why a weight [out, in] cannot be the kernel's (torch's packing and GROUP), or None."""
    if in_features % GROUP:
        return f"{in_features} inputs, not a multiple of {GROUP}"
    if out_features % ROW_MULTIPLE:
        return f"{out_features} outputs, not a multiple of {ROW_MULTIPLE}"
    return None


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """A weight [N, K] as 4-bit codes in `planes` planes side by side along the inputs:
    w[n, perm[k]] = sum_p (codes[n, pK + k] - 8) * scale[n, g_p] + zero[n, g_p], g_p = (pK + k) // 32.

    `perm` (None: the identity) is the input column each code column stands for: an act-order GPTQ
    weight's groups are scattered over the inputs, and sorting the columns by group makes each a
    run of whole 32-column groups; the layer then multiplies x[:, perm]."""

    codes: torch.Tensor  # [N, planes * K] uint8 in [0, 15]
    scale: torch.Tensor  # [N, planes * K / 32] float32
    zero: torch.Tensor  # [N, planes * K / 32] float32
    act_dtype: torch.dtype = torch.bfloat16  # what the layer multiplies them with
    planes: int = 1  # 2: 8-bit codes u = 16 h + l as a high plane [h] and a low one [l]
    perm: torch.Tensor | None = None  # [K] int64: input column of each code column (None: in order)
    # True: the layer never quantizes its inputs to int8 (fp32: the W4A32 kernel, `matmul_exact`;
    # bf16: no few-row int8 path); False: fp32 inputs go to int8 per group, as llama.cpp's Q4 x Q8_1.
    exact_inputs: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] // self.planes))

    def to(self, device: str | torch.device) -> Int4Codes:
        if torch.device(device).type != "cpu":
            raise ValueError("int4 packed weights run on the CPU only")
        return self

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, the inputs in their order (`perm` undone)."""
        n, pk = self.codes.shape
        groups = (self.codes.float() - 8).view(n, pk // GROUP, GROUP)
        w = (groups * self.scale[..., None] + self.zero[..., None]).view(n, self.planes, pk // self.planes)
        w = w[:, 0] if self.planes == 1 else w.sum(dim=1)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, order: torch.Tensor) -> Int4Codes:
        """The same weight with its output rows reordered (`order`: [N] row indices)."""
        return replace(self, codes=self.codes[order], scale=self.scale[order], zero=self.zero[order])

    def for_dtype(self, dtype: torch.dtype, exact_inputs: bool = False) -> Int4Codes:
        return replace(self, act_dtype=dtype, exact_inputs=exact_inputs)


def quantize_rtn(weight: torch.Tensor) -> Int4Codes:
    """Round-to-nearest 4-bit codes of a float weight [N, K] (K a multiple of 32), asymmetric per
    group of 32: the group's min and max are exact, the rest within half a step."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Codes(codes.view(n, k), scale, lo + 8 * scale)


def codes_of_gguf_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Int4Codes | None:
    """The 4-bit codes of a Q4_0 / Q4_1 / Q4_K tensor from its raw blocks (None for any other type)."""
    from pdserve.quant.gguf_packed import FOUR_BIT_TYPES, int4_codes, parse_blocks

    return int4_codes(parse_blocks(raw, ggml_type, shape)) if ggml_type in FOUR_BIT_TYPES else None


def read_gguf_codes(path: Path, names: dict[str, str]) -> dict[str, Int4Codes]:
    """{HF name: codes} of the tensors of `names` ({GGUF name: HF name}) that are 4-bit in the file
    (Q4_0 / Q4_1 / Q4_K); the rows are as the file stores them (undo llama.cpp's Q/K permutation after)."""
    from pdserve.quant.gguf_packed import int4_codes, read_packed

    return {n: int4_codes(c) for n, c in read_packed(path, names)[0].items() if c.bits == 4}


def weights_for(checkpoint, config) -> tuple[dict[str, torch.Tensor | Int4Codes], str]:
    """(the weights an engine of `config` runs on `checkpoint`, "dense", "int4" or "packed"):
    --weight-format resolved by pdserve.quant.gguf_packed.weights_for."""
    from pdserve.quant.gguf_packed import weights_for as resolve

    return resolve(checkpoint, config)


def engine_weights(checkpoint, config) -> tuple[dict[str, object], str]:
    """`weights_for`'s, with the output head (and tied embedding) kept as the engine keeps it
    (quant.q8_head.pack_head): what Engine.from_checkpoint runs, and every rank of a pipeline."""
    from pdserve.quant.q8_head import pack_head

    weights, weight_format = weights_for(checkpoint, config)
    return pack_head(weights, checkpoint, config, weight_format), weight_format


def pack_weights(weights: dict[str, torch.Tensor], config, act_dtype: torch.dtype,
                 from_file: dict[str, Int4Codes] | None = None,
                 rtn_others: bool = True, exact_inputs: bool = False) -> dict[str, torch.Tensor | Int4Codes]:
    """`weights` with every projection (config.arch.projection_names) as 4-bit codes for `act_dtype`:
    the file's own (`from_file`, read from the GGUF: rows put back in HF order here, as the reader
    does) where it has them, round-to-nearest of the float weight otherwise (or, `rtn_others`
    False, the float weight as it is). Norms, embeddings and the output head stay as they are."""
    from pdserve.runtime.gguf_reader import unpermute_rope_rows

    arch = config.arch
    projections = arch.projection_names(config)
    replaced = set(projections)
    # Not dict(weights): a lazily loaded projection that the codes replace is never read (lazy_weights).
    out: dict[str, torch.Tensor | Int4Codes] = {n: weights[n] for n in weights if n not in replaced}
    for name in projections:
        codes = (from_file or {}).get(name)
        if codes is None:
            if not rtn_others:
                out[name] = weights[name]  # the float weight as loaded
                continue
            if weights[name].shape[1] % GROUP:
                raise ConfigError(f"4-bit weights take a projection's inputs in groups of {GROUP}: {name} has "
                                  f"{weights[name].shape[1]}; serve this model with --weight-format dense or auto")
            codes = quantize_rtn(weights[name])
        else:
            heads = arch.gguf_permuted_heads(name, config)
            if heads is not None:
                order = unpermute_rope_rows(torch.arange(codes.shape[0])[:, None], heads)[:, 0]
                codes = codes.rows(order)
        out[name] = codes.for_dtype(act_dtype, exact_inputs)
    return out
