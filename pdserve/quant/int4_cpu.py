"""4-bit weights kept packed on the CPU, multiplied by torch's weight-packed int4 kernel.

Why: decoding a few streams reads every weight once per step, so on a CPU its speed is the memory
bandwidth over the weights' bytes; 4-bit codes are a quarter of bf16's. torch ships the kernel
(`torch._weight_int4pack_mm_for_cpu`, the "tinygemm" layout: codes packed along the output rows,
one scale and zero per group of input columns and output row, w = (q - 8) * scale + zero); no
hand-written kernel is needed. It is fast with bf16 (or fp16) activations, slow with fp32, and
slower than a dense bf16 matmul from about 16-32 rows on (it dequantizes per row tile). Over a
whole SmolLM2 decode step it wins up to 16 streams and loses a few percent at 32 (the step's other
costs hide the matmuls), at a quarter of the memory: `--weight-format auto` takes it where the
file's projections are 4-bit already and the compute is bf16/fp16 on a CPU. With fp32 activations
(`--weight-format int4 --dtype float32`, for a CPU without native bf16) one-plane codes run our C
kernel instead (runtime.kernels.cpu_int4_matmul: inputs quantized to int8 per group of 32, integer
dot products, as llama.cpp runs Q4_1), on our packing only.

Codes come from the GGUF file itself where its tensors are 4-bit (Q4_0, Q4_1, Q4_K: read by
pdserve.quant.gguf_packed), re-packed once at load: the same codes llama.cpp runs, with the scales
rounded to the activation dtype. Other weights (float; for `int4`, also Q8_0 and the other
K-quants) are quantized here by round-to-nearest over groups of 32 (asymmetric min/max), which
adds error. 8-bit and 5-bit codes (`--weight-format packed`) run as two 4-bit planes in one call
(`Int4Codes.planes`, see gguf_packed). GPTQ checkpoints' 4- and 8-bit codes are converted too
(pdserve.quant.gptq_cpu); act-order ones carry an input permutation (`Int4Codes.perm`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.quant.int4_codes import GROUP, Int4Codes
from pdserve.quant.onednn_linear import ONEDNN_LINEAR, linear_packed, onednn_packed, onednn_packed_f32
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.kernels.cpu_int4_matmul import AMX_BELOW_ROWS

# From this many rows on (a prefill chunk), dequantizing the weight and running a dense matmul beats
# the kernel, whose cost grows with every row (0.042 ms per row and SmolLM2 layer at 2 threads; two
# planes, 8-bit codes: 0.085), while dequantizing in place then multiplying costs 3.0 ms + 0.017 per
# row: crossover 112-128 rows for one plane, 40-56 for two (`python benchmarks/gguf_packed_bench.py
# --crossover 32,48,64,96,128,160`, quiet machine).
DENSE_FROM_ROWS = 128
DENSE_FROM_ROWS_TWO_PLANES = 48
# With the dense weight kept (keep_dense_copy), nothing to dequantize: a decode step of this many
# sequences or more runs the dense bf16 matmul (oneDNN), which beats the kernel from about 14 (whole
# SmolLM2 decode steps at 1 thread, Xeon with AVX512-BF16, kernel against dense: 49.7 / 53.8 ms at 12
# sequences, 63.3 / 60.1 at 16, 86.3 / 62.7 at 24, 111.0 / 69.2 at 32). Below it a dense step still
# costs about its weights' reading (51.4 ms at 8 against 40.1). Two planes cost the kernel twice.
DENSE_COPY_FROM_ROWS = 16
DENSE_COPY_FROM_ROWS_TWO_PLANES = 8
# The kept copy in oneDNN's own blocked layout (`onednn_packed`): the same kernel and bits as F.linear
# on the plain weight, without the re-layout of the weight that F.linear pays on every call. All 30
# SmolLM2 layers' projections at one thread (Xeon, AMX): 8 rows 29.8 -> 18.4 ms, 32 rows 28.5 -> 22.5,
# 200 rows 61.1 -> 35.9; torch's int4 kernel takes 19.2 ms at 8 rows, 28.4 at 12: dense from 8 rows.
DENSE_PACKED_FROM_ROWS = 8

# Prompt rows' dense matmul in fp32 (Int4Linear._dense_row_invariant): oneDNN's, at least this many
# rows (fewer take another kernel); without oneDNN, MKL's in chunks of exactly PROMPT_GEMM_ROWS rows.
PROMPT_GEMM_MIN_ROWS = 16
PROMPT_GEMM_ROWS = 32
_ONEDNN_LINEAR = ONEDNN_LINEAR  # a module attribute: tests turn the oneDNN path off here

# In fp32 the C kernel's int8 inputs round differently from the dense matmul, so which of the two a
# token takes must not depend on what else its step holds (other sequences, chunking, speculation,
# the worker it runs on): a forward marks its rows, generated tokens on the kernel, prompt tokens
# dense (the kept copy, else dequantized). Unmarked (outside a forward): by row count, as above.
_generated_rows: contextvars.ContextVar[RowKinds | None] = contextvars.ContextVar("int4_rows", default=None)


@dataclass(frozen=True, slots=True)
class RowKinds:
    """A forward's rows by token kind: `generated` and `prompt` row indices ([G], [P] int64)."""

    generated: torch.Tensor
    prompt: torch.Tensor

    @classmethod
    def of(cls, generated: torch.Tensor) -> RowKinds:
        """generated: [N] bool, True for a row whose token the model generated."""
        return cls(generated.nonzero().flatten(), (~generated).nonzero().flatten())


def token_kinds_of(generated: torch.Tensor | None) -> contextlib.AbstractContextManager[None]:
    """`token_kinds` of a forward's rows, `generated` [N] bool (AttentionMetadata.generated_rows; None:
    untold, the projections then choose by row count)."""
    return token_kinds(None if generated is None else RowKinds.of(generated))


@contextlib.contextmanager
def token_kinds(rows: RowKinds | None) -> Iterator[None]:
    """Within it, Int4Linear calls in fp32 run `rows.generated` on the kernel, `rows.prompt` dense."""
    token = _generated_rows.set(rows)
    try:
        yield
    finally:
        _generated_rows.reset(token)


@dataclass(frozen=True, slots=True)
class Q8Form:
    """A 4-bit weight as our C kernel reads it (runtime.kernels.cpu_int4_matmul, inputs quantized to
    int8 per group): w[n, k] = q[n, k] * scale[n, k / 32] + mins[n, k / 32] (+ bias[n])."""

    nibbles: torch.Tensor  # [N, K / 2] uint8: byte j holds code 2j (low nibble) and 2j + 1 (high)
    scale: torch.Tensor  # [N, K / 32] fp32
    mins: torch.Tensor  # [N, K / 32] fp32
    bias: torch.Tensor | None  # [N] fp32
    exact: bool = False  # fp32 inputs as they are (`matmul_exact`), not quantized to int8 (`matmul`)


class Int4Linear:
    """y = x @ W^T (+ b) with W as packed 4-bit codes; x in `dtype` (bf16 or fp16), any row count.

    The kernel's packing (one byte per two codes) is the only copy of the codes where its layout is
    the one `kernel_block_rows` knows (output rows a multiple of its blocks): steps of `dense_from_rows`
    rows or more dequantize the weight from it and run a dense matmul. Elsewhere a second packing of
    ours (two codes a byte) is kept to dequantize from. Two planes (8-bit codes) run as one kernel
    call on [x, x]: the kernel sums both planes' products in fp32. With a column permutation
    (`Int4Codes.perm`, act-order GPTQ) every call multiplies x[:, perm], one gather of the [M, K]
    input, and `dequantized()` is the weight in that permuted column order.

    `q8` (our C kernel's form, `Q8Form`) is kept for fp32 activations, which run on it, and for bf16
    ones with one plane in order, whose steps of fewer than BF16_Q8_BELOW_ROWS rows run on it (its
    bf16 entry point): a bf16 token's bits then depend on its step's row count, below 5, below 16
    (torch's kernel) or not (dense), as they do by the dense threshold already.

    `amx` (the AMX kernel's copy of the codes, `amx_runs`) replaces torch's packing on a CPU with
    AMX-BF16: bf16 calls of 5 to AMX_BELOW_ROWS - 1 rows run on it (the dense copy's weights, only the
    order of the fp32 sums differing), larger ones dense.

    `q8_gemm` (the VNNI GEMM's copy, `cpu_int4_matmul.q8_gemm_panels`) comes with the dense copy on a CPU
    with AVX512-VNNI and no AMX, and replaces torch's packing: in a forward, generated tokens' rows run on
    it however few, so a generated token's projections are the same sums whatever its step holds. With a
    dense copy (any CPU) a forward's prompt tokens' rows take it however few (exact bf16 products) and
    its generated ones their kernels, a mixed step split by kind as fp32's `token_kinds` does
    (`_by_kind`); rows of no told kind go by their count (`_bf16_by_count`). With `int8_prompts` (asked
    of `keep_dense_copy`, taken where the VNNI GEMM is) no copy is kept: prompt rows run the GEMM however
    few (`_prompt_rows`: each row's bits its own, whatever the call holds), as llama.cpp runs Q4_1
    prompts, and rows of no told kind from 5 a call too."""

    __slots__ = ("packed", "scales_and_zeros", "nibbles", "scale", "zero", "bias", "out_features", "in_features",
                 "dtype", "planes", "dense_from_rows", "dense", "perm", "mins", "q8", "amx", "amx_bias", "q8_gemm",
                 "int8_prompts")

    def __init__(self, codes: Int4Codes, bias: torch.Tensor | None = None) -> None:
        n, pk = codes.codes.shape
        dtype, p = codes.act_dtype, codes.planes
        if pk % (GROUP * p):
            raise ValueError(f"int4 weights need input features divisible by {GROUP}, got {pk // p}")
        # fp32 activations with one plane: our C kernel, on our packing (torch's kernel is slow in fp32).
        ours = dtype == torch.float32 and p == 1 and cpu_int4_matmul.available()
        amx = amx_runs(codes)
        few_rows = (dtype == torch.bfloat16 and p == 1 and codes.perm is None and not codes.exact_inputs
                    and cpu_int4_matmul.available())
        # [N / B, K, B / 2] bytes: torch's kernel's packing (none where ours or the AMX kernel runs every
        # call; dropped by keep_dense_copy where the VNNI GEMM takes its calls).
        self.packed = None if ours or amx else torch._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 1)
        # [P K / 32, N, 2]: the kernel's layout of (scale, zero) per group and output row.
        self.scales_and_zeros = torch.stack([codes.scale.t(), codes.zero.t()], dim=-1).to(dtype).contiguous()
        block = kernel_block_rows()
        own = ours or amx or few_rows or block is None or n % block
        # [N, P K / 2] uint8, contiguous: the C kernel reads whole rows (codes may come as a transposed view);
        # kept for bf16 `q8` too (shared with its form), as `_keep_q8_gemm` may drop torch's packing
        self.nibbles = _nibbles(codes.codes) if own else None
        self.scale = self.scales_and_zeros[..., 0].t()  # [N, P K / 32] views: the kernel's rounded values
        self.zero = self.scales_and_zeros[..., 1].t()
        # [N, K / 32] fp32: w = q * scale + mins, the C kernel's form of (q - 8) * scale + zero.
        self.mins = (self.zero - 8 * self.scale).contiguous() if ours else None
        if ours:
            self.scale = self.scale.contiguous()
        self.bias = None if bias is None else bias.to(dtype).contiguous()
        self.out_features, self.in_features, self.dtype, self.planes = n, pk // p, dtype, p
        # (fp32, ours: a forward's rows go by token kind instead; this count only outside one)
        self.dense_from_rows = DENSE_FROM_ROWS if p == 1 else DENSE_FROM_ROWS_TWO_PLANES
        # [out, in]: `dequantized()` kept (keep_dense_copy), plain or in oneDNN's layout (`dense_packed`)
        self.dense: torch.Tensor | None = None
        self.perm = codes.perm  # [in] int64 or None: the input column of each weight column
        if p == 2 and not torch.equal(self.scale[:, :pk // 2 // GROUP], 16 * self.scale[:, pk // 2 // GROUP:]):
            raise ValueError("two-plane int4 weights need the high plane's scales to be 16x the low plane's")
        self.q8 = self._q8_form(codes) if ours or few_rows else None
        # The VNNI GEMM's copy of the codes and of the Q8 form's scales (`q8_gemm_panels`), made with the
        # dense copy (`keep_dense_copy`): bf16 rows of generated tokens, however few, then run on it.
        self.q8_gemm: cpu_int4_matmul.Q8GemmWeights | None = None
        self.int8_prompts = False  # every bf16 row on the int8 kernels, no dense copy kept (`keep_dense_copy`)
        # [N / 16, K / 32, 16, 16] uint8: the AMX kernel's copy of the codes (`amx_runs`), with the scales above
        self.amx = cpu_int4_matmul.amx_codes(codes.codes) if amx else None
        # [N] fp32: the AMX kernel's bias, made here rather than per call (the Q8 form's where there is one)
        self.amx_bias = None if not amx or self.bias is None else (
            self.q8.bias if self.q8 is not None else self.bias.float().contiguous())

    def _q8_form(self, codes: Int4Codes) -> Q8Form:
        nibbles = self.nibbles if self.nibbles is not None else _nibbles(codes.codes)
        scale = self.scale.float().contiguous()  # the kernel's rounded values, as the other paths use
        mins = self.mins if self.mins is not None else (self.zero.float() - 8 * scale).contiguous()
        bias = None if self.bias is None else self.bias.float().contiguous()
        return Q8Form(nibbles, scale, mins, bias, exact=codes.exact_inputs)

    @classmethod
    def fused(cls, parts: Sequence[Int4Codes], bias: torch.Tensor | None = None) -> Int4Linear:
        """One linear whose outputs are the parts' outputs concatenated (fused q/k/v, gate/up); the
        parts have the same number of planes and the same input permutation (`same_inputs`)."""
        if not same_inputs(parts):
            raise ValueError("fused int4 parts need the same planes and input permutation")
        return cls(Int4Codes(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                             torch.cat([p.zero for p in parts]), parts[0].act_dtype, parts[0].planes,
                             parts[0].perm, parts[0].exact_inputs), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.perm is not None:  # the weight's columns are sorted by group: so are the inputs'
            x = permute_columns(x, self.perm)
        if self.mins is not None:  # fp32: generated rows on the C kernel, prompt rows dense (`token_kinds`)
            return self._by_kind(x, self._dense_row_invariant, self._kernel, self._fp32_by_count)
        if self.dense is not None or self.int8_prompts:
            return self._by_kind(x, self._prompt_rows, self._bf16_generated, self._bf16_by_count)
        return self._bf16_by_count(x)

    def _by_kind(self, x: torch.Tensor, prompt: Callable, generated: Callable, untold: Callable) -> torch.Tensor:
        """x [M, K] split by the forward's token kinds (`token_kinds`): `prompt` on its prompt tokens' rows,
        `generated` on its generated ones'; `untold` on all of them where the forward does not say
        (outside one, or teacher-forced logits)."""
        m = x.shape[0]
        kinds = _generated_rows.get()
        if kinds is None or len(kinds.generated) + len(kinds.prompt) != m:
            return untold(x)
        if len(kinds.generated) == 0:
            return prompt(x)
        if len(kinds.prompt) == 0:
            return generated(x)
        y = torch.empty((m, self.out_features), dtype=x.dtype)
        y[kinds.prompt] = prompt(x[kinds.prompt])
        y[kinds.generated] = generated(x[kinds.generated])
        return y

    def _gemm(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] bf16 on the VNNI GEMM where it is kept (each row's bits its own, at any row count);
        None where it is not, or declines x."""
        return None if self.q8_gemm is None else cpu_int4_matmul.matmul_q8_gemm(x, self.q8_gemm, self.q8.bias)

    def _prompt_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Prompt tokens' rows: the VNNI GEMM however few where `int8_prompts`, else the copy's exact
        products however few. Either way the same call at any row count: a prompt's chunk of 1-4 tokens (a
        short prompt, a chunked one's tail, the rest after a cached prefix) took the `q8` kernel before, so
        its arithmetic, and its first generated token, depended on how the scheduler cut the prompts."""
        y = self._gemm(x) if self.int8_prompts else None
        return self._dense(x) if y is None else y

    def _bf16_generated(self, x: torch.Tensor) -> torch.Tensor:
        """Generated tokens' rows beside a dense copy (or with `int8_prompts`): the VNNI GEMM however few
        where it is kept, else by their count. With its next panels fetched ahead (int4_q8_gemm.c) the GEMM
        beats the few-row `q8` kernel from one row on (SmolLM2's 30 layers, 2-core Zen 4: 5.5 / 5.7 / 5.7
        ms at 1 / 2 / 4 rows against 6.9 / 9.3 / 14.6), and a token's bits no longer depend on whether its
        step held fewer than 5 rows."""
        y = self._gemm(x)
        return self._bf16_by_count(x) if y is None else y

    def _fp32_by_count(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 by its row count: the C kernel below `dense_from_rows`, else dense."""
        return self._kernel(x) if x.shape[0] < self.dense_from_rows else self._dense_row_invariant(x)

    def _bf16_by_count(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bf16 by its row count: the `q8` kernel below 5 rows, the AMX kernel below AMX_BELOW_ROWS
        where it runs, torch's int4 kernel below `dense_from_rows` where its packing is kept, else dense."""
        m = x.shape[0]
        if m < cpu_int4_matmul.BF16_Q8_BELOW_ROWS and self.q8 is not None:
            y = cpu_int4_matmul.matmul_bf16(x, self.q8.nibbles, self.q8.scale, self.q8.mins, self.q8.bias)
            if y is not None:
                return y
        if self.amx is not None and m < AMX_BELOW_ROWS:
            y = cpu_int4_matmul.matmul_amx(x, self.amx, self.scales_and_zeros, self.out_features, self.amx_bias)
            if y is not None:
                return y
        y = self._gemm(x) if self.int8_prompts else None  # no dense copy kept: the int8 kernels at every count
        if y is not None:
            return y
        if self.amx is not None or self.packed is None or m >= self.dense_from_rows:
            return self._dense(x)
        xs = x.contiguous() if self.planes == 1 else torch.cat([x] * self.planes, dim=-1)  # [M, P K]
        y = torch._weight_int4pack_mm_for_cpu(xs, self.packed, GROUP, self.scales_and_zeros)  # [M, out]
        return y if self.bias is None else y + self.bias

    def _dense_row_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 -> [M, out] dense, each row's bits independent of M and of the thread count.

        A BLAS GEMM picks its kernel and its split of the sums by the row count (MKL's sgemm on
        AVX-512: one kernel below 16 rows, another above, and from about 58 rows on two threads a
        third for K = 1536), and the kernel's int8 inputs of the next layer turn such an ulp into a
        whole quantization step near a rounding boundary: a greedy token then depends on what else
        its step held. oneDNN's fp32 matmul keeps one reduction order per row from 3 rows on, at one
        thread or two (measured for SmolLM2's four shapes, every M up to 600), at MKL's speed; rows
        are padded to PROMPT_GEMM_MIN_ROWS. Without oneDNN: MKL in chunks of exactly
        PROMPT_GEMM_ROWS rows (the same call whatever the step holds, about 1.7x the time)."""
        m, k = x.shape
        if _ONEDNN_LINEAR:
            if m < PROMPT_GEMM_MIN_ROWS:
                x = torch.cat([x, x.new_zeros((PROMPT_GEMM_MIN_ROWS - m, k))])
            weight = self.dense if self.dense_packed else self._dense_weight()  # the same bits either way
            return linear_packed(x, weight, self.bias)[:m]
        weight = self._dense_weight()
        chunks = -(-m // PROMPT_GEMM_ROWS)
        padded = x.new_zeros((chunks * PROMPT_GEMM_ROWS, k))
        padded[:m] = x
        y = torch.empty((chunks * PROMPT_GEMM_ROWS, self.out_features), dtype=torch.float32)
        for c in range(chunks):
            rows = slice(c * PROMPT_GEMM_ROWS, (c + 1) * PROMPT_GEMM_ROWS)
            y[rows] = F.linear(padded[rows], weight, self.bias)
        return y[:m]

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        q8 = self.q8
        matmul = cpu_int4_matmul.matmul_exact if q8.exact else cpu_int4_matmul.matmul
        return matmul(x, q8.nibbles, q8.scale, q8.mins, q8.bias)  # [M, out]

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_packed:
            return linear_packed(x, self.dense, self.bias)
        return F.linear(x, self._dense_weight(), self.bias)

    @property
    def rows_split_by_kind(self) -> bool:
        """Whether a forward's prompt rows take a row-invariant dense GEMM and its generated rows their
        own kernel as one group (`_by_kind`: fp32, or bf16 with the dense copy), so that leaving prompt
        rows out of a call changes no other row's bits (LlamaModel's last layer, `OutputRows`)."""
        return self.mins is not None or self.dense is not None or self.int8_prompts

    @property
    def dense_packed(self) -> bool:
        """Whether the kept copy is in oneDNN's layout (`onednn_packed`), for `linear_packed` only."""
        return self.dense is not None and self.dense.is_mkldnn

    def _dense_weight(self) -> torch.Tensor:
        """[out, in]: the kept dense copy (plain), else the codes dequantized for this call."""
        return self.dequantized() if self.dense is None or self.dense_packed else self.dense

    def codes_f32(self) -> torch.Tensor:
        """The codes as float32 [N, K]: 4-bit ones, or (two planes) u = 16 h + l in [0, 255]."""
        n, k = self.out_features, self.in_features
        if self.nibbles is not None:
            c = torch.stack([self.nibbles & 0x0F, self.nibbles >> 4], dim=-1).view(n, self.planes, k)
            return (c[:, 0] if self.planes == 1 else (c[:, 0] << 4) | c[:, 1]).float()
        # The kernel's layout (kernel_block_rows): blocks of B rows, per input column B / 2 bytes.
        b = kernel_block_rows()
        v = self.packed.view(n // b, self.planes * k, b // 2)
        if self.planes == 1:
            t = unpack_kernel_nibbles(v)
        else:
            h, l = v[:, :k], v[:, k:]
            t = unpack_kernel_nibbles(h, (h << 4) | (l & 0x0F), (h & 0xF0) | (l >> 4))
        return t.to(torch.float32, memory_format=torch.contiguous_format).view(n, k)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in the activation dtype, from the codes and the kernel's scales (its
        columns in `perm` order where there is one: what the calls multiply x[:, perm] with)."""
        n, k = self.out_features, self.in_features
        codes = self.codes_f32().view(n, k // GROUP, GROUP)
        # In fp32, rounded once at the end, as the kernel does: both paths multiply the same weight.
        # In place: a fresh [N, K] fp32 temporary per step costs its page faults, more than the math.
        if self.planes == 1:
            w = codes.sub_(8).mul_(self.scale.float()[..., None]).add_(self.zero.float()[..., None])
        else:  # (h - 8) 16 s + (l - 8) s + z = (u - 136) s + z, the high plane's zero being 0
            g = k // GROUP
            s, z = self.scale[:, g:].float(), self.zero[:, g:].float() + self.zero[:, :g].float()
            w = codes.sub_(136).mul_(s[..., None]).add_(z[..., None])
        return w.view(n, k).to(self.dtype)

    def keep_dense_copy(self, int8_prompts: bool = False) -> None:
        """Keeps `dequantized()` for the calls of `dense_from_rows` rows or more, which otherwise
        dequantize the weight on every call: with SmolLM2's 4-bit codes at 1 thread that is about
        40 % of a 200-token prompt's prefill. Costs the weight's dense size in memory. The copy is
        the tensor each call would compute (columns permuted like the calls' inputs), so a call that
        went dense before gives the same bits. With bf16 / fp16 activations the dense path also
        takes calls from DENSE_COPY_FROM_ROWS rows on (decode steps of 16 or more sequences), where
        the dense matmul beats the kernel once nothing is dequantized: those rows' bits then differ
        from the kernel's by the order of the fp32 sums (same weights, same products). fp32 goes by
        token kind instead (`token_kinds`), its copy in oneDNN's layout where that keeps the plain
        weight's bits (`onednn_packed_f32`). bf16 / fp16 keep it in oneDNN's layout where torch has oneDNN
        (`onednn_packed`: the same bits, faster), taking the dense path from DENSE_PACKED_FROM_ROWS.
        `int8_prompts`: where the VNNI GEMM is kept, every bf16 row runs the int8 kernels (prompt rows the
        GEMM, `_prompt_rows`; rows of no told kind too, `_bf16_by_count`), so nothing would read the copy and
        none is kept (SmolLM2: 212 MB less a worker)."""
        if self.mins is None:
            self._keep_q8_gemm()
            self.int8_prompts = int8_prompts and self.q8_gemm is not None
            if self.int8_prompts:
                return
        self.dense = self.dequantized()
        if self.mins is not None:  # fp32: prompt rows only, on oneDNN's GEMM (`_dense_row_invariant`)
            packed = onednn_packed_f32(self.dense) if _ONEDNN_LINEAR else None
            self.dense = self.dense if packed is None else packed
        else:
            self.dense_from_rows = DENSE_COPY_FROM_ROWS if self.planes == 1 else DENSE_COPY_FROM_ROWS_TWO_PLANES
            packed = onednn_packed(self.dense)
            if packed is not None:
                self.dense = packed
                self.dense_from_rows = min(self.dense_from_rows, DENSE_PACKED_FROM_ROWS)

    def _keep_q8_gemm(self) -> None:
        """With the dense copy, on a CPU with AVX512-VNNI and no AMX: the VNNI GEMM takes the generated
        rows that took the copy or torch's kernel (and prompt rows where `int8_prompts`), so torch's
        packing is dropped (SmolLM2: -53 MB, +80 MB for the GEMM's codes and scales)."""
        if (self.q8 is not None and self.amx is None and self.out_features % cpu_int4_matmul.Q8_GEMM_PANEL == 0
                and cpu_int4_matmul.q8_gemm_available()):
            self.q8_gemm = cpu_int4_matmul.q8_gemm_panels(self.q8.nibbles, self.q8.scale, self.q8.mins)
            self.packed = None

    @property
    def nbytes(self) -> int:
        ts = [self.scales_and_zeros] + [t for t in (self.packed, self.nibbles, self.bias, self.dense, self.perm,
                                                    self.mins) if t is not None]
        if self.q8 is not None and self.mins is None:  # bf16's own Q8 form (fp32's shares its tensors)
            ts += [t for t in (self.q8.scale, self.q8.mins, self.q8.bias) if t is not None]
            ts += [self.q8.nibbles] if self.nibbles is None else []
        if self.amx is not None:
            ts.append(self.amx)
        if self.amx_bias is not None and self.q8 is None:  # its own (else the Q8 form's, counted above)
            ts.append(self.amx_bias)
        gemm = 0 if self.q8_gemm is None else self.q8_gemm.nbytes
        return sum(t.numel() * t.element_size() for t in ts) + gemm


def amx_runs(codes: Int4Codes) -> bool:
    """Whether a linear of these codes runs its bf16 calls on the AMX kernel (`AMX_BELOW_ROWS`): one
    plane, both sizes multiples of its panel, a CPU with AMX-BF16. (A column permutation is applied to
    the inputs before any kernel: the codes are in its order.)"""
    n, k = codes.codes.shape
    return (codes.act_dtype == torch.bfloat16 and codes.planes == 1
            and n % cpu_int4_matmul.AMX_PANEL == 0 and k % cpu_int4_matmul.AMX_PANEL == 0
            and cpu_int4_matmul.amx_available())


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> [N, K / 2] bytes, contiguous: byte j holds code 2j (low) and 2j + 1 (high)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def permute_columns(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x[:, perm] of a 2-D x of a 2- or 4-byte float dtype: [M, K] -> [M, K], exact.

    One row: index_select, the quickest there. More: gather on the bits as integers, about 1.5-2x
    index_select along the last dim from 4-8 rows on (K = 576, 1 thread)."""
    if x.shape[0] == 1:
        return x.index_select(-1, perm)
    bits = torch.int16 if x.element_size() == 2 else torch.int32
    return torch.gather(x.view(bits), -1, perm.expand(x.shape[0], -1)).view(x.dtype)


def same_inputs(parts: Sequence[Int4Codes]) -> bool:
    """Whether `parts` can be one fused Int4Linear: the same planes, input permutation and input precision."""
    first = parts[0]
    return all(p.planes == first.planes and p.exact_inputs == first.exact_inputs and (p.perm is None) == (first.perm is None)
               and (p.perm is None or torch.equal(p.perm, first.perm)) for p in parts)


@functools.cache
def kernel_block_rows() -> int | None:
    """Output rows per block of torch's CPU int4 packing where it is a layout `Int4Linear.codes_f32`
    reads (None: another one, then a copy of ours is kept). torch packs by its kernel's vector width:
    blocks of 64 rows with AVX-512, of 32 with AVX2; in both, per input column B / 2 bytes, byte j
    holding row j (low nibble) and row B / 2 + j (high nibble). Checked once on random codes."""
    codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    v = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    if v.dtype != torch.uint8 or v.numel() != codes.numel() // 2:
        return None
    for rows in (64, 32):
        got = unpack_kernel_nibbles(v.view(128 // rows, 64, rows // 2)).to(torch.int32, memory_format=torch.contiguous_format)
        if torch.equal(got.view(128, 64), codes):
            return rows
    return None


def unpack_kernel_nibbles(v: torch.Tensor, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """[N / B, K, B / 2] bytes of the kernel's packing (or their low / high nibbles, given) ->
    [N / B, 2, B / 2, K] codes, rows in order once flattened: a transposed view, so that the caller's
    conversion (to float32, contiguous) does the transposing copy."""
    lo = v & 0x0F if lo is None else lo
    hi = v >> 4 if hi is None else hi
    return torch.stack([lo, hi], dim=1).transpose(2, 3)
