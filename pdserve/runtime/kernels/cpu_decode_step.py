"""A decode step of a 4-bit model in one C call on the CPU (kernels/cpu/decode_step.c).

The CPU's counterpart of CUDA graph replay: where a step holds only decode tokens (one generated
token per sequence), every layer runs in C without returning to Python, through the very functions
the eager step calls one at a time, in the same order, so both steps give the same bits. It runs on
`StepThreads`' count (--step-threads, the host's core share, else torch's for the calling thread):
the C side starts the extra threads for the step and splits each phase over them (projections by output rows, the rest by sequences), which changes no
bit either. Where another process keeps a core busy the step's threads sleep at its barriers instead
of waiting out the scheduler's time slices, and the plan then runs the next LOADED_STEPS steps on
one thread (`StepThreads`). `DecodeStepPlan.of` returns None for a model it does not
cover: a projection that is not 4-bit on our kernel (`Int4Linear.q8`), a column permutation,
tensor parallelism, shapes past the attention's buffers. The cache is in the activations' dtype or
holds INT8 codes (`--kv-dtype int8`: written by kv_write.c and read by paged_attention*.c, the eager
step's functions for it). fp32 models run every decode-only step of generated tokens here; bf16 ones
those of fewer than BF16_Q8_BELOW_ROWS sequences, whose projections the eager step also runs on our
kernel (larger ones take torch's matmuls), on a CPU with AMX-BF16 those of fewer than
AMX_BELOW_ROWS, whose projections the eager step runs on the AMX kernel (int4_amx.c) and SiLU in C,
and on a CPU with AVX512-VNNI and no AMX, where the projections keep the VNNI GEMM's copy
(`Int4Linear.q8_gemm`: a worker's dense copy brings it), every step of generated tokens, whose
projections the eager step runs on that GEMM (int4_q8_gemm.c) at any row count.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.runtime.attention import AttentionMetadata
from pdserve.runtime.kernels import cpu_attention
from pdserve.runtime.kernels.cpu_int4_matmul import AMX_BELOW_ROWS, BF16_Q8_BELOW_ROWS
from pdserve.runtime.kv_cache import block_size_of

_P, _I = ctypes.c_void_p, ctypes.c_int64
# After a step whose threads mostly slept at its barriers (another process, such as the prefill
# worker beside a decode worker, had the cores), this many steps run on one thread, which beats two
# sharing one core (a one-sequence SmolLM2 step beside a busy process: 10.5 against 13.8 ms).
LOADED_STEPS = 32
# ... but only after LOADED_OF_WINDOW of the last LOADED_WINDOW steps were such steps. A single one
# is as often a cold step (the first after a prefill, or after the KV of a new request was placed)
# or a short preemption (the gateway, the worker's own gRPC threads) as a busy neighbour. Two in a
# row (what this took before) came every hundred steps or so through the stack at one stream, and
# each put the next 32 on one thread: 43% of a run's steps (SmolLM2 fp32, 2-core AVX2 EPYC; TPOT
# 14.1 ms, against 9.5 ms a step on two threads). A neighbour that keeps a core busy makes nearly
# every step loaded, and still meets the window within a few steps.
LOADED_WINDOW = 8
LOADED_OF_WINDOW = 6


class StepThreads:
    """How many threads the next step runs on: `wanted` (a count, or a function giving the count of
    the moment: the host's core share; 0: the calling thread's torch count), or one for LOADED_STEPS
    steps once LOADED_OF_WINDOW of the last LOADED_WINDOW steps found their cores taken."""

    def __init__(self, wanted: int | Callable[[], int] = 0) -> None:
        self.wanted = wanted
        self.solo_steps = 0
        self.recent = 0  # the last LOADED_WINDOW steps run on `wanted`, a bit each: 1 = loaded

    def next(self) -> int:
        if self.solo_steps:
            self.solo_steps -= 1
            return 1
        wanted = self.wanted() if callable(self.wanted) else self.wanted
        return wanted or torch.get_num_threads()

    def after(self, loaded: bool) -> None:
        self.recent = ((self.recent << 1) | int(loaded)) & ((1 << LOADED_WINDOW) - 1)
        if self.recent.bit_count() >= LOADED_OF_WINDOW:
            self.solo_steps, self.recent = LOADED_STEPS, 0


class _Int4Weights(ctypes.Structure):
    _fields_ = [("codes", _P), ("scale", _P), ("mins", _P), ("bias", _P), ("out_features", _I), ("in_features", _I),
                ("exact", _I), ("amx_codes", _P), ("amx_scale_zero", _P), ("gemm_codes", _P), ("gemm_scale", _P),
                ("gemm_mins", _P)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Int4Weights), ("o", _Int4Weights),
                ("gate_up", _Int4Weights), ("down", _Int4Weights)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [("batch", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("num_layers", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", _P), ("sin", _P), ("max_positions", _I), ("positions", _P), ("slots", _P), ("cache", _P),
                ("cache_blocks", _I), ("cache_layers", _I), ("block_size", _I), ("block_tables", _P), ("max_blocks", _I),
                ("context_lens", _P), ("final_norm", _P), ("bf16", _I), ("amx_from_rows", _I),
                ("kv_int8", _I), ("q8_gemm_from_rows", _I)]


def _int4_weights(linear, dtype: torch.dtype) -> _Int4Weights | None:
    """A projection as the C step reads it, or None where it is not on our 4-bit kernel in `dtype`."""
    from pdserve.quant.int4_cpu import Int4Linear  # noqa: PLC0415 (quant imports the runtime)

    if not isinstance(linear, Int4Linear) or linear.q8 is None or linear.perm is not None or linear.dtype != dtype:
        return None
    q8 = linear.q8
    bias = 0 if q8.bias is None else q8.bias.data_ptr()
    amx = (0, 0) if linear.amx is None else (linear.amx.data_ptr(), linear.scales_and_zeros.data_ptr())
    gemm = (0, 0, 0) if linear.q8_gemm is None else (
        linear.q8_gemm.codes.data_ptr(), linear.q8_gemm.scale.data_ptr(), linear.q8_gemm.mins.data_ptr())
    return _Int4Weights(q8.nibbles.data_ptr(), q8.scale.data_ptr(), q8.mins.data_ptr(), bias,
                        linear.out_features, linear.in_features, int(q8.exact), *amx, *gemm)


def _norm_ptr(weight: torch.Tensor, dtype: torch.dtype) -> int | None:
    ok = weight.dtype == dtype and weight.device.type == "cpu" and weight.is_contiguous()
    return weight.data_ptr() if ok else None


@dataclass(frozen=True)
class DecodeStepPlan:
    """A model's layers as pointers for the C step; it holds the model, so they stay valid."""

    model: object  # the LlamaModel
    planned: tuple  # its DecoderLayers, held: the pointers point into their tensors
    layers: ctypes.Array
    dtype: torch.dtype  # activations, norms and KV cache: fp32 or bf16
    threads: StepThreads = field(default_factory=StepThreads)
    # bf16: every projection has the AMX kernel's codes (Int4Linear.amx), so steps of BF16_Q8_BELOW_ROWS
    # to AMX_BELOW_ROWS - 1 sequences run here too, their projections on it as the eager step's do
    amx: bool = False
    # bf16: every projection has the VNNI GEMM's copy (Int4Linear.q8_gemm), so steps of generated tokens
    # of any size run here, their projections on the GEMM as the eager step's are
    q8_gemm: bool = False

    @classmethod
    def of(cls, model) -> DecodeStepPlan | None:
        """The plan of `model` (a LlamaModel), or None where the C step does not cover it."""
        from pdserve.runtime.model import DecoderLayer  # noqa: PLC0415 (the model imports this module)

        lib, c = cpu_attention.library(), model.config
        if not model.layers or not all(type(layer) is DecoderLayer for layer in model.layers):
            return None  # wrapped or replaced layers (a test's taps, another stage's): theirs to run
        first, dtype = model.layers[0].ctx, getattr(model.layers[0].qkv, "dtype", None)
        if (lib is None or first is None or first.all_reduce is not None or first.cos.dtype != torch.float32
                or not first.cos.is_contiguous() or not first.sin.is_contiguous() or first.cos.device.type != "cpu"
                or c.num_heads > cpu_attention.MAX_HEADS or c.head_dim > cpu_attention.MAX_HEAD_DIM
                or dtype not in (torch.float32, torch.bfloat16) or _norm_ptr(model.final_norm, dtype) is None):
            return None
        d, width = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        layers = (_LayerWeights * len(model.layers))()
        for i, layer in enumerate(model.layers):
            weights = [_int4_weights(p, dtype) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            norms = [_norm_ptr(layer.input_norm, dtype), _norm_ptr(layer.post_norm, dtype)]
            if None in weights or None in norms or layer.index != i:  # i: its layer in the cache too
                return None
            shapes = [(w.out_features, w.in_features) for w in weights]
            inter = shapes[3][1]
            if shapes != [(width, d), (d, c.num_heads * c.head_dim), (2 * inter, d), (d, inter)]:
                return None
            layers[i] = _LayerWeights(*norms, *weights)
        projections = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        amx, q8_gemm = all(w.amx_codes for w in projections), all(w.gemm_codes for w in projections)
        return cls(model, tuple(model.layers), layers, dtype, StepThreads(getattr(model, "step_threads", 0)), amx,
                   q8_gemm)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """Whether the step of `meta` runs here: decode tokens only, activations of the plan's dtype and a
        cache of it or of INT8 codes, the layers it planned; in fp32 each token generated (a prompt's last token run as
        a decode takes the dense matmul: `int4_cpu.token_kinds`), in bf16 fewer than BF16_Q8_BELOW_ROWS, or
        each token generated where the projections have the VNNI GEMM's copy (`q8_gemm`)."""
        if (meta.prefills or meta.num_decode_tokens != hidden.shape[0] or kv_cache.dtype not in (self.dtype, torch.int8)
                or hidden.dtype != self.dtype or not kv_cache.is_contiguous()
                or len(self.model.layers) != len(self.planned)
                or not all(a is b for a, b in zip(self.model.layers, self.planned))):  # none replaced since
            return False
        generated = meta.generated_rows is not None and bool(meta.generated_rows.all())
        if self.dtype == torch.bfloat16:
            few = hidden.shape[0] < (AMX_BELOW_ROWS if self.amx else BF16_Q8_BELOW_ROWS)
            return few or (self.q8_gemm and generated)
        return generated

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            kv_cache: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] the tokens' embeddings -> the final norm's output [B, D]; writes the step's KV."""
        model, c = self.model, self.model.config
        ctx = model.layers[0].ctx
        step_tensors = [t.to(torch.int64).contiguous() for t in
                        (positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)]
        pos, slots, tables, lens = step_tensors
        hidden = hidden.contiguous()
        out = torch.empty_like(hidden)
        step = _DecodeStep(hidden.shape[0], c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           model.layers[0].down.in_features, len(model.layers), c.rms_norm_eps, model.scale,
                           ctx.cos.data_ptr(), ctx.sin.data_ptr(), ctx.cos.shape[0], pos.data_ptr(), slots.data_ptr(),
                           kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.shape[1], block_size_of(kv_cache),
                           tables.data_ptr(), tables.shape[1], lens.data_ptr(), model.final_norm.data_ptr(),
                           int(self.dtype == torch.bfloat16), BF16_Q8_BELOW_ROWS if self.amx else 0,
                           int(kv_cache.dtype == torch.int8), int(self.q8_gemm))  # GEMM from 1 row
        loaded = ctypes.c_int64(0)
        err = cpu_attention.library().decode_step(ctypes.byref(step), self.layers, hidden.data_ptr(),
                                                      out.data_ptr(), self.threads.next(), ctypes.byref(loaded))
        self.threads.after(bool(loaded.value))
        if err == 1:
            raise MemoryError(f"no memory for a decode step of {hidden.shape[0]} sequences")
        if err == 2:
            raise IndexError(f"a position past the RoPE tables ({ctx.cos.shape[0]} positions)")
        if err == 4:
            raise IndexError(f"a KV slot outside the cache ({kv_cache.shape[0]} blocks of {block_size_of(kv_cache)})")
        if err:
            raise RuntimeError(f"the C decode step refused its shapes (error {err})")
        return out
