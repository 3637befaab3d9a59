"""The output head (and tied embedding) kept as 8-bit codes on the CPU.

Why: SmolLM2's tied 49152 x 576 head is 113 MB in fp32, read whole by every decode step: with the
projections 4-bit it is the largest read of a one-stream step. The GGUF stores it as Q8_0 (one fp16
scale per 32 weights, codes in -127..127); re-deriving those codes from the loaded fp32 weight is
exact (`Q8Head.from_dense`), so keeping them changes no weight, and the C kernel
(runtime.kernels.cpu_int4_matmul.matmul_int8) multiplies them with the hidden states quantized to
int8 per group of 32, as llama.cpp runs a Q8_0 head. Embedding rows are read from the same codes.
Taken where the projections run our fp32 int4 kernel and the file's head is Q8_0 (`pack_head`).

With bf16 compute (projections packed, a CPU with AVX512-BF16) the codes come from the file (the
loaded weight is rounded to bf16) and steps of fewer than BF16_KERNEL_BELOW_ROWS rows multiply them
by the bf16 hidden states without quantizing those (kernels/cpu/bf16_matmul.c): the same bf16
weights and products as the dense matmul, at half its bytes. Larger steps use the dense bf16 weight,
kept in oneDNN's blocked layout where torch has oneDNN (`packed`: F.linear re-lays a plain weight out
on every call; SmolLM2's head at 32 rows, 2 threads: 2.51 -> 1.55 ms, the same bits), else plain
(`dense`). The embedding reads the plain weight, or, beside the packed one, rounds the codes' rows
to bf16: the loaded weight's bits (it was rounded from the same products), without a second copy.

On a CPU with AVX512-VNNI and no AMX, every bf16 call runs the VNNI GEMM on the codes instead, and no
dense weight is kept (`with_gemm`, kernels/cpu/int4_q8_gemm.c's 8-bit tiles): the hidden states quantized
to int8 per group of 32, as llama.cpp runs a Q8_0 head and as this CPU's int4 projections run every
generated token; one kernel at every row count, so a row's logits depend on nothing else in its step. SmolLM2's
head, one thread, caches flushed between calls (Zen 4, stop 55): 2.12 against 3.22 ms at 1 row, 3.75
against 5.42 at 10, 5.77 against 8.08 at 20. Perplexity on README.md (benchmarks/int4_perplexity.py,
the generated rows' arithmetic): 51.19 with it against 51.27 with the bf16 head, no cost resolved.

On a CPU with AMX-BF16, steps of BF16_KERNEL_BELOW_ROWS to 32 rows (decode steps of 5-32 sequences)
multiply the codes on AMX tiles instead (kernels/cpu/int4_amx.c: each panel of
codes widened to the bf16 weight, bit for bit, then the dense matmul's products): 32 MB read a step
instead of the dense weight's 57, in blocks of their own layout (`amx_blocks`, 32 MB more resident).
SmolLM2's head, its weights from memory (`benchmarks/q8_head_bench.py`, a 2-core Xeon), one thread:
7.7 against 8.3 ms at 8 rows, 9.6-9.8 against 11.1-11.5 at 32; two threads: 4.0 against 4.4 at 8,
5.2 against 6.0 at 32. From 33 rows the tiles multiply twice a panel and the dense matmul is faster
(40 rows: 11.0 against 9.6 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.quant.onednn_linear import linear_packed, onednn_packed
from pdserve.runtime.config import FOUR_BIT_FORMATS, PACKED_WEIGHT_FORMATS
from pdserve.runtime.kernels import cpu_int4_matmul

GROUP = 32
# bf16: the codes' kernel for steps of fewer rows, the dense bf16 matmul (oneDNN) from this many on
# (SmolLM2's head alone, one thread, Xeon with AVX512-BF16: 1.98 against 3.50 ms at 1 row, 3.62
# against 3.97 at 4, 6.06 against 3.92 at 8; whole decode step at 1 sequence 15.0 -> 13.7 ms).
BF16_KERNEL_BELOW_ROWS = 5
# bf16 steps of BF16_KERNEL_BELOW_ROWS up to this many rows (exclusive) on the AMX kernel where it runs:
# one 32-row run of the tiles a panel.
AMX_BELOW_ROWS = 33


@dataclass(frozen=True, slots=True)
class Q8Head:
    """w[v, d] = codes[v, d] * scale[v, d / 32]: the head [V, D] (and the embedding, where tied)."""

    codes: torch.Tensor  # [V, D] int8 in -127..127
    scale: torch.Tensor  # [V, D / 32] float32
    dense: torch.Tensor | None = None  # [V, D] bf16: the plain weight for bf16 compute
    packed: torch.Tensor | None = None  # the bf16 weight in oneDNN's layout instead (`with_packed`)
    exact_inputs: bool = False  # fp32: hidden states as they are (W8A32), not quantized to int8
    amx_blocks: torch.Tensor | None = None  # [V / 16, D / 32, 576] uint8: the codes for AMX (bf16 compute)
    gemm: cpu_int4_matmul.Q8GemmWeights | None = None  # the codes for the VNNI GEMM (bf16 compute, `with_gemm`)

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

    @classmethod
    def from_file(cls, path: Path, gguf_name: str, dense: torch.Tensor) -> Q8Head | None:
        """The file's Q8_0 codes and scales of tensor `gguf_name`, beside `dense`, its loaded bf16 weight
        (None where the file's tensor is not Q8_0)."""
        from pdserve.quant.gguf_packed import read_packed

        packed, types = read_packed(path, {gguf_name: "head"})
        if types.get("head") != "Q8_0":
            return None
        blocks = packed["head"]  # codes stored as q + 128
        codes = (blocks.codes.to(torch.int16) - 128).to(torch.int8)
        return cls(codes.contiguous(), blocks.scale.contiguous(), dense)

    def with_packed(self) -> Q8Head:
        """This bf16 head with its dense weight in oneDNN's blocked layout instead of plain (itself
        where torch has no oneDNN or it has no plain bf16 weight)."""
        packed = None if self.dense is None else onednn_packed(self.dense)
        return self if packed is None else replace(self, dense=None, packed=packed)

    def with_amx_blocks(self) -> Q8Head:
        """This bf16 head with its codes also laid out for the AMX kernel where it runs (itself
        elsewhere, or for fp32 compute, or a shape the kernel does not take)."""
        v, d = self.codes.shape
        if (self.bf16_weight is None or v % cpu_int4_matmul.AMX_PANEL or d % cpu_int4_matmul.AMX_PANEL
                or not cpu_int4_matmul.amx_available()):
            return self
        return replace(self, amx_blocks=cpu_int4_matmul.amx_int8_blocks(self.codes, self.scale))

    def with_gemm(self) -> Q8Head:
        """This bf16 head with its codes laid out for the VNNI GEMM instead of its dense weight, where the GEMM
        runs and AMX does not (itself elsewhere, or for fp32 compute): every call then runs it (`__call__`),
        and the embedding's rows come from the codes, so the dense bf16 weight has no reader (57 MB)."""
        v, d = self.codes.shape
        if (self.bf16_weight is None or self.amx_blocks is not None or v % (2 * cpu_int4_matmul.Q8_GEMM_PANEL)
                or d % GROUP or not cpu_int4_matmul.q8_gemm_available()):
            return self
        return replace(self, gemm=cpu_int4_matmul.q8_head_panels(self.codes, self.scale), dense=None, packed=None)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def bf16_weight(self) -> torch.Tensor | None:
        """The kept bf16 weight, packed or plain (None: fp32 compute)."""
        return self.packed if self.packed is not None else self.dense

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the head serves (its embedding rows' dtype)."""
        if self.gemm is not None:  # the GEMM takes bf16 hidden states
            return torch.bfloat16
        weight = self.bf16_weight
        return torch.float32 if weight is None else weight.dtype

    @property
    def nbytes(self) -> int:
        dense = 0 if self.bf16_weight is None else self.codes.numel() * self.dtype.itemsize
        amx = 0 if self.amx_blocks is None else self.amx_blocks.numel()
        gemm = 0 if self.gemm is None else self.gemm.nbytes
        return self.codes.numel() + self.scale.numel() * 4 + dense + amx + gemm

    def to(self, device: str | torch.device) -> Q8Head:
        if torch.device(device).type != "cpu":
            raise ValueError("the 8-bit head runs on the CPU only")
        return self

    def dequantize(self) -> torch.Tensor:
        """[V, D] float32."""
        v, d = self.codes.shape
        return (self.codes.float().view(v, d // GROUP, GROUP) * self.scale[..., None]).view(v, d)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> rows [N, D]: bf16 where the head computes in bf16 (the plain weight's rows, or the
        codes' rounded: the same bits), else float32, dequantized."""
        if self.dense is not None:
            return F.embedding(ids, self.dense)
        rows = F.embedding(ids, self.codes).float()  # [N, D]
        n, d = rows.shape
        rows = (rows.view(n, d // GROUP, GROUP) * F.embedding(ids, self.scale)[..., None]).view(n, d)
        return rows.to(self.dtype)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] -> logits [S, V] float32."""
        if self.gemm is not None:  # every row count: a row's logits whatever its step holds
            y = cpu_int4_matmul.matmul_q8_head(hidden, self.gemm)
            if y is not None:
                return y
        if self.bf16_weight is not None:
            rows = hidden.shape[0]
            if rows < BF16_KERNEL_BELOW_ROWS:
                y = cpu_int4_matmul.matmul_int8_bf16(hidden, self.codes, self.scale)
                if y is not None:  # rounded to bf16 as the dense matmul's output is: the same precision
                    return y.to(torch.bfloat16).float()
            elif rows < AMX_BELOW_ROWS and self.amx_blocks is not None:
                y = cpu_int4_matmul.matmul_int8_amx(hidden, self.amx_blocks, self.codes.shape[0])
                if y is not None:  # bf16, as the dense matmul's output
                    return y.float()
            if self.packed is not None:
                return linear_packed(hidden, self.packed, None).float()
            return F.linear(hidden, self.dense).float()
        x = hidden.float()
        matmul = cpu_int4_matmul.matmul_int8_exact if self.exact_inputs else cpu_int4_matmul.matmul_int8
        y = matmul(x, self.codes, self.scale)
        return F.linear(x, self.dequantize()) if y is None else y


def gguf_tensor_type(path: Path, name: str) -> str | None:
    """The GGML type name of tensor `name` in the GGUF file at `path` (None: no such tensor)."""
    from pdserve.runtime import gguf_tensors

    return next((t.tensor_type.name for t in gguf_tensors.places(path) if t.name == name), None)


def pack_head(weights: dict[str, object], checkpoint, config, weight_format: str) -> dict[str, object]:
    """`weights` with the head (the embedding where tied) as a Q8Head where that keeps every weight
    as the file has it and a kernel for it runs: the file's head Q8_0, on the CPU, and either fp32
    compute with weight format int4 (the fp32 int4 kernel's int8 inputs) or int4-exact (the hidden
    states as they are), or bf16 compute with packed projections on a CPU with AVX512-BF16.
    Otherwise `weights` unchanged."""
    model = checkpoint.config
    fp32 = weight_format in FOUR_BIT_FORMATS and config.dtype == "float32" and cpu_int4_matmul.available()
    bf16 = weight_format in PACKED_WEIGHT_FORMATS and config.dtype == "bfloat16" and cpu_int4_matmul.bf16_available()
    if not (fp32 or bf16) or not config.device.startswith("cpu") or checkpoint.source.suffix != ".gguf":
        return weights
    arch = model.arch
    embed, head = arch.global_name("embed"), arch.global_name("lm_head")
    tied = model.tie_word_embeddings or head not in weights
    name = embed if tied else head  # tied: the file's token embedding is the head
    gguf_name = arch.to_gguf(name)
    if model.hidden_size % GROUP:
        return weights
    if fp32:  # the loaded fp32 weight is the file's exactly: its codes re-derived, the file read once
        is_q8 = gguf_tensor_type(checkpoint.source, gguf_name) == "Q8_0"
        codes = Q8Head.from_dense(weights[name]) if is_q8 else None
        if codes is not None and weight_format == "int4-exact":
            codes = replace(codes, exact_inputs=True)
    else:  # the loaded weight is rounded to bf16: the codes from the file, its types read with them
        codes = Q8Head.from_file(checkpoint.source, gguf_name, weights[name])
        codes = None if codes is None else codes.with_packed().with_amx_blocks().with_gemm()
    if codes is None:
        return weights
    return {**weights, name: codes, **({head: codes} if tied else {})}
