"""The output head (and tied embedding) kept as 8-bit codes on the CPU, for fp32 compute.

Why: SmolLM2's tied 49152 x 576 head is 113 MB in fp32, read whole by every decode step: with the
projections 4-bit it is the largest read of a one-stream step. The GGUF stores it as Q8_0 (one fp16
scale per 32 weights, codes in -127..127); re-deriving those codes from the loaded fp32 weight is
exact (`Q8Head.from_dense`), so keeping them changes no weight, and the C kernel
(runtime.kernels.cpu_int4_matmul.matmul_int8) multiplies them with the hidden states quantized to
int8 per group of 32, as llama.cpp runs a Q8_0 head. Embedding rows are read from the same codes.
Taken where the projections run our fp32 int4 kernel and the file's head is Q8_0 (`pack_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.runtime.kernels import cpu_int4_matmul

GROUP = 32


@dataclass(frozen=True, slots=True)
class Q8Head:
    """w[v, d] = codes[v, d] * scale[v, d / 32]: the head [V, D] (and the embedding, where tied)."""

    codes: torch.Tensor  # [V, D] int8 in -127..127
    scale: torch.Tensor  # [V, D / 32] float32

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> Q8Head:
        """Symmetric 8-bit codes per group of 32 (scale = amax / 127). Of a Q8_0 tensor's
        dequantization, exactly its codes and scales (its fp16 scale times 127 is exact in fp32)."""
        v, d = w.shape
        groups = w.float().view(v, d // GROUP, GROUP)
        scale = groups.abs().amax(-1) / 127  # [V, G]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (groups / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(codes.view(v, d).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4

    def to(self, device: str | torch.device) -> Q8Head:
        if torch.device(device).type != "cpu":
            raise ValueError("the 8-bit head runs on the CPU only")
        return self

    def dequantize(self) -> torch.Tensor:
        """[V, D] float32."""
        v, d = self.codes.shape
        return (self.codes.float().view(v, d // GROUP, GROUP) * self.scale[..., None]).view(v, d)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> rows [N, D] float32, dequantized."""
        rows = F.embedding(ids, self.codes).float()  # [N, D]
        n, d = rows.shape
        return (rows.view(n, d // GROUP, GROUP) * F.embedding(ids, self.scale)[..., None]).view(n, d)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] -> logits [S, V] float32."""
        x = hidden.float()
        y = cpu_int4_matmul.matmul_int8(x, self.codes, self.scale)
        return F.linear(x, self.dequantize()) if y is None else y


def gguf_tensor_type(path: Path, name: str) -> str | None:
    """The GGML type name of tensor `name` in the GGUF file at `path` (None: no such tensor)."""
    from gguf import GGUFReader

    return next((t.tensor_type.name for t in GGUFReader(path).tensors if t.name == name), None)


def pack_head(weights: dict[str, object], checkpoint, config, weight_format: str) -> dict[str, object]:
    """`weights` with the head (the embedding where tied) as a Q8Head where that keeps every weight
    as the file has it and the fp32 int4 kernel runs: weight format int4, fp32 compute on the CPU,
    the file's head Q8_0. Otherwise `weights` unchanged."""
    model = checkpoint.config
    if (weight_format != "int4" or config.dtype != "float32" or not config.device.startswith("cpu")
            or checkpoint.source.suffix != ".gguf" or not cpu_int4_matmul.available()):
        return weights
    arch = model.arch
    embed, head = arch.global_name("embed"), arch.global_name("lm_head")
    tied = model.tie_word_embeddings or head not in weights
    name = embed if tied else head  # tied: the file's token embedding is the head
    if model.hidden_size % GROUP or gguf_tensor_type(checkpoint.source, arch.to_gguf(name)) != "Q8_0":
        return weights
    codes = Q8Head.from_dense(weights[name])
    return {**weights, name: codes, **({head: codes} if tied else {})}
