"""Decode attention read in place from the paged KV cache on the CPU (kernels/cpu/paged_attention.c).

torch's CPU path (torch_ops.paged_decode_attention_torch, the reference) copies each sequence's
blocks into a padded tensor and runs the flash kernel, whose fixed cost per (sequence, head) rules at
one query per head. The C functions compute the scores and the weighted values straight from the
blocks, with the softmax between them, in one call (kernels/cpu/layer_ops.c). Built once per machine with the system C compiler
(about a second; no torch headers) into a cache directory, loaded with ctypes, which releases the
GIL during the call. Where no compiler is found or the build fails, `paged_decode_attention`
returns None and the caller runs the torch path (one log line says why). The same library holds the
INT8 KV write (kernels/cpu/kv_write.c, called through `cpu_kv_write`) and the 4-bit weight
matmul for fp32 activations (kernels/cpu/int4_matmul.c, through `cpu_int4_matmul`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pdserve.runtime.kernels.step_memo import per_step
from pdserve.runtime.kv_cache import block_size_of

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "paged_attention.c"
# One library from all sources (one build, one cache entry, one portable file): the decode attention's
# fp32 AVX2 passes (paged_attention_f32.c) and bf16-over-INT8 AVX512-BF16 ones (paged_attention_i8.c);
# the INT8 KV write (kv_write.c, loaded by cpu_kv_write) ships with the decode attention that reads
# what it writes; the 4- and 8-bit weight matmuls (int4_matmul.c for fp32 inputs quantized to int8,
# int4_exact.c for them as they are, bf16_matmul.c for an 8-bit head's bf16 inputs, int4_amx.c for
# 4-bit weights and an 8-bit head on AMX tiles with bf16 inputs: all through cpu_int4_matmul), the
# layer's row operations (layer_ops.c, cpu_layer_ops) and the one-call decode step built on all of
# them (decode_step.c, cpu_decode_step).
SOURCES = (SOURCE, *(SOURCE.with_name(name) for name in (
    "paged_attention_f32.c", "paged_attention_i8.c", "kv_write.c", "int4_matmul.c", "int4_exact.c",
    "bf16_matmul.c", "layer_ops.c", "decode_step.c", "int4_amx.c", "int4_q8_gemm.c", "prefill_attention.c")))
# included: part of the cache key
HEADERS = tuple(SOURCE.with_name(name) for name in (
    "bf16.h", "threads.h", "int4_common.h", "q8_widen.h", "attention_avx512.h"))
# -march=native: the library is built where it runs (the file name carries the CPU's identity).
# -fopenmp: its entry points split their work on the calling thread's OpenMP team, torch's own
# (kernels/cpu/threads.h says why).
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_QUERY_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_CACHE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32", torch.int8: "i8"}
_KERNELS = [("bf16", "bf16"), ("f32", "f32"), ("bf16", "i8"), ("f32", "i8")]  # (query, cache) built
# q, out, scores, scale; cache, tables, lens; batch, max_blocks, heads, kv_heads, dim, block_size,
# block_stride, k_offset, v_offset, t_pad, threads
_ATTENTION_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 11
# q, out, scores, scale; cache, table, lens; n, heads, kv_heads, dim, block_size, block_stride, k_offset,
# v_offset, t_pad, threads
_PREFILL_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 10
# cache, k, v; k and v row strides; slots; n, num_blocks, kv_heads, dim, block_size, block_stride, layer_offset
_KV_WRITE_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 7
KV_WRITE_INPUTS = ("f32", "bf16")  # kv_write_int8_<input> built
# x, m, k, x_stride; codes, scale, mins, bias; n, y, y_stride, threads (the `_threads` entry points)
_INT4_LINEAR_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
# x, m, k, x_stride; codes, scale; n, y, y_stride, threads (int4_q8_gemm.c's 8-bit codes)
_Q8_HEAD_GEMM_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
# x, m, k, x_stride; xq, xd, xsum (int4_q8_gemm.c's input quantization, for tests)
_Q8_QUANTIZE_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
# x, m, k, x_stride; codes, scale_zero, bias; n, y, y_stride, threads (int4_amx.c)
_AMX_LINEAR_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
# x, m, k, x_stride; codes, scale; n, y, y_stride, threads
_INT8_LINEAR_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
# x, m, k, x_stride; blocks (codes and scales); n, y, y_stride, threads (int4_amx.c)
_INT8_AMX_LINEAR_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
_P, _I = ctypes.c_void_p, ctypes.c_int64
# The row operations of kernels/cpu/layer_ops.c (called through cpu_layer_ops).
_LAYER_OPS_ARGS = {
    # x, x_stride, residual, weight, n, d, eps, out, summed
    "add_rms_norm_f32": [_P, _I, _P, _P, _I, _I, ctypes.c_float, _P, _P],
    # x, x_stride, n, heads, dim, positions, cos, sin, max_positions, out
    "rope_f32": [_P, _I, _I, _I, _I, _P, _P, _P, _I, _P],
    # gate_up, stride, n, inter, out
    "silu_mul_f32": [_P, _I, _I, _I, _P],
    # cache, k, k_stride, v, v_stride, slots, n, row_bytes, block_size, block_stride, k_offset, num_slots
    "kv_write_rows": [_P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I],
    # scores, rows, t_pad, per_len, lens (decode attention's softmax; the tests call it alone)
    "softmax_rows_f32": [_P, _I, _I, _I, _P],
    # logits, rows, cols, row stride, out (int64 [rows]): greedy sampling's argmax
    "argmax_rows_f32": [_P, _I, _I, _I, _P],
}
# Their bf16 versions take the same arguments (bf16 rows, fp32 eps and RoPE tables).
_LAYER_OPS_ARGS.update({f"{name}_bf16": _LAYER_OPS_ARGS[f"{name}_f32"] for name in ("add_rms_norm", "rope", "silu_mul")})


def cache_dir() -> Path:
    """Where built libraries are kept: $XDG_CACHE_HOME/pdserve/kernels (else ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "kernels"


def _cpu_identity() -> str:
    """The CPU model and flags (a library built with -march=native runs only where they match)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
                         + " ".join((compiler, *CFLAGS)).encode()
                         + _cpu_identity().encode()).hexdigest()[:16]
    return cache_dir() / f"paged_attention-{platform.machine()}-{key}.so"


# An image without a compiler (or with a read-only home) uses a library built into the package at
# image build time (`build_portable()`, run by the Dockerfile), for a
# baseline CPU of its architecture rather than the build machine's.
PORTABLE = SOURCE.with_name(f"paged_attention-{platform.machine()}-portable.so")
PORTABLE_MARCH = {"x86_64": "-march=x86-64-v3", "aarch64": "-march=armv8-a"}  # AVX2 + FMA on x86


def _build(compiler: str, target: Path, flags: tuple[str, ...] = CFLAGS) -> None:
    """Compiles SOURCES into one library `target`, atomically (concurrent workers may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES)], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_portable(target: Path = PORTABLE) -> Path:
    """Builds the library for this architecture's baseline CPU (not -march=native) into `target`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("no C compiler (cc, gcc or $CC) to build the CPU attention kernel with")
    march = PORTABLE_MARCH.get(platform.machine())
    flags = tuple(f for f in CFLAGS if f != "-march=native") + ((march,) if march else ())
    _build(compiler, target, flags)
    return target


def _native_library() -> tuple[ctypes.CDLL | None, str]:
    """(the library built for this CPU, else None and why)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler found"
    path = _library_path(compiler)
    try:
        if not path.exists():
            _build(compiler, path)
        return ctypes.CDLL(str(path)), ""
    except (OSError, subprocess.SubprocessError) as err:
        detail = (getattr(err, "stderr", b"") or b"").decode(errors="replace")[-300:]
        return None, f"{err} {detail}".strip()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels built for this CPU, else the package's portable build, else None (logged once)."""
    lib, why = _native_library()
    if lib is None and PORTABLE.exists():
        try:
            lib = ctypes.CDLL(str(PORTABLE))
            log.info("CPU paged attention: the package's portable build (%s)", why)
        except OSError as err:
            why = f"{why}; {PORTABLE.name}: {err}"
    if lib is None:
        log.warning("CPU paged attention kernel unavailable (%s): torch's path runs instead "
                    "(decode attention and the INT8 KV write)", why)
        return None
    for query, cache in _KERNELS:
        getattr(lib, f"paged_attention_{query}_{cache}_threads").argtypes = _ATTENTION_ARGS
    for inputs in KV_WRITE_INPUTS:
        getattr(lib, f"kv_write_int8_{inputs}").argtypes = _KV_WRITE_ARGS
    for name, argtypes in _LAYER_OPS_ARGS.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, ctypes.c_int if name.startswith(("rope", "kv_write")) else None
    lib.paged_prefill_bf16_threads.argtypes, lib.paged_prefill_bf16_threads.restype = _PREFILL_ARGS, ctypes.c_int
    lib.decode_step.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p]
    lib.decode_step.restype = ctypes.c_int
    for name, argtypes in (("int4_linear_f32", _INT4_LINEAR_ARGS), ("int4_linear_bf16", _INT4_LINEAR_ARGS),
                           ("int8_linear_f32", _INT8_LINEAR_ARGS), ("int8_linear_bf16", _INT8_LINEAR_ARGS),
                           ("int4_linear_exact_f32", _INT4_LINEAR_ARGS), ("int8_linear_exact_f32", _INT8_LINEAR_ARGS),
                           ("int8_amx_linear", _INT8_AMX_LINEAR_ARGS), ("int4_q8_gemm_bf16", _INT4_LINEAR_ARGS)):
        getattr(lib, f"{name}_threads").argtypes, getattr(lib, f"{name}_threads").restype = argtypes, ctypes.c_int
    lib.bf16_dot_available.argtypes, lib.bf16_dot_available.restype = [], ctypes.c_int
    lib.int4_amx_available.argtypes, lib.int4_amx_available.restype = [], ctypes.c_int
    lib.int4_q8_gemm_available.argtypes, lib.int4_q8_gemm_available.restype = [], ctypes.c_int
    lib.int4_amx_linear_threads.argtypes, lib.int4_amx_linear_threads.restype = _AMX_LINEAR_ARGS, ctypes.c_int
    lib.int8_q8_gemm_threads.argtypes, lib.int8_q8_gemm_threads.restype = _Q8_HEAD_GEMM_ARGS, ctypes.c_int
    lib.q8_quantize_bf16.argtypes, lib.q8_quantize_bf16.restype = _Q8_QUANTIZE_ARGS, ctypes.c_int
    return lib


MAX_HEAD_DIM, MAX_HEADS = 256, 64  # the C side's fixed buffers
MIN_UNITS_PER_THREAD = 2  # decode attention: at least this many (sequence, kv head) pairs a thread


def _kernel_suffix(q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    pair = (_QUERY_SUFFIX.get(q.dtype), _CACHE_SUFFIX.get(kv_cache.dtype))
    return "_".join(pair) if pair in _KERNELS else None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel runs this call: on the CPU, a bf16 / fp32 query over a cache of its own dtype
    or of INT8 codes, contiguous, within the C side's buffers."""
    heads, dim = q.shape[1], q.shape[2]
    return (q.device.type == "cpu" and _kernel_suffix(q, kv_cache) is not None and kv_cache.is_contiguous()
            and dim <= MAX_HEAD_DIM and heads <= MAX_HEADS and library() is not None)


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q: [B, H, D]; block_tables: [B, MB] (padded); context_lens: [B] -> out [B, H, D] in q's dtype, or
    None when this kernel does not apply (dtype, layout, no library): the caller runs torch's path."""
    if not supports(q, kv_cache):
        return None
    # The same for every layer of the step: int64 tables and lengths, and the scores' scratch
    # ([B, H, T]: each call writes, then reads, only its sequences' first context_len columns).
    tables, lens, scores = per_step("c_decode_attention", (block_tables, context_lens, q.shape[1]), lambda: (
        block_tables.to(torch.int64).contiguous(), context_lens.to(torch.int64).contiguous(),
        _scores_scratch(q, block_tables.shape[1], kv_cache)))
    return _attend(q, kv_cache, layer, tables, lens, scores, scale)


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_table: torch.Tensor,
                            context_len: int, scale: float) -> torch.Tensor | None:
    """Causal attention of one sequence's n new tokens, the last n positions of a context of
    `context_len` whose keys and values are in the blocks of `block_table` ([MB]): q [n, H, D] -> out
    [n, H, D], or None where the kernel does not apply (as `paged_decode_attention`).

    Why the decode kernel: row i is one query over the first context_len - n + i + 1 positions of
    the same blocks, which is what it computes for a batch of n "sequences" sharing a table, reading
    the cache in place with bf16 dot products. torch's flash kernel took 18-21 % of a bf16 prefill of
    200-token prompts in chunks of about 500 tokens (SmolLM2, one thread, 2-core AMD EPYC: a chunk
    after a prefix repeats the kv heads and adds a mask; on this CPU its dots run on fp32 sgemm)."""
    if not supports(q, kv_cache):
        return None
    n = q.shape[0]
    table, lens, scores = per_step("c_prefill_attention", (block_table, n, context_len, q.shape[1]), lambda: (
        block_table.to(torch.int64).contiguous(),  # [MB]
        torch.arange(context_len - n + 1, context_len + 1, dtype=torch.int64),  # [n]: each row's context
        _scores_scratch(q, block_table.shape[0], kv_cache)))
    out = _prefill_tiles(q, kv_cache, layer, table, lens, scores, scale)
    if out is not None:
        return out
    # The per-row kernel: n "sequences" sharing one table, each its own row of it.
    tables = per_step("c_prefill_tables", (table, n), lambda: table[None].expand(n, -1).contiguous())  # [n, MB]
    return _attend(q, kv_cache, layer, tables, lens, scores, scale)


def _prefill_tiles(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, table: torch.Tensor, lens: torch.Tensor,
                   scores: torch.Tensor, scale: float) -> torch.Tensor | None:
    """kernels/cpu/prefill_attention.c: the rows of q [n, H, D] in tiles sharing each run of keys and values
    while it is in L1, each row's bits the per-row kernel's; None where it does not apply (not a bf16 query
    over a bf16 cache, no AVX512-BF16, a shape its register-held sums do not take)."""
    if _kernel_suffix(q, kv_cache) != "bf16_bf16":
        return None
    n, h, d = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if library().paged_prefill_bf16_threads(q.data_ptr(), out.data_ptr(), scores.data_ptr(), scale,
                                            kv_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), n, h,
                                            kv_cache.shape[4], d, *_cache_geometry(kv_cache, layer),
                                            scores.shape[2], threads_for(n, 8)):
        return None
    return out


def _cache_geometry(kv_cache: torch.Tensor, layer: int) -> tuple[int, int, int, int]:
    """(block_size, block_stride, k_offset, v_offset) of `layer` in a [blocks, layers, 2, rows, KVH, D]
    cache, in elements: what the C kernels take to find a block's keys and values."""
    _, layers, _, rows, kvh, d = kv_cache.shape
    chunk = rows * kvh * d  # elements of one (block, layer, k/v) run
    return block_size_of(kv_cache), layers * 2 * chunk, 2 * layer * chunk, (2 * layer + 1) * chunk


def _scores_scratch(q: torch.Tensor, max_blocks: int, kv_cache: torch.Tensor) -> torch.Tensor:
    """[B, H, MB * block_size] fp32: the scores of each row's context, written before they are read."""
    return torch.empty((q.shape[0], q.shape[1], max_blocks * block_size_of(kv_cache)), dtype=torch.float32)


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, tables: torch.Tensor, lens: torch.Tensor,
            scores: torch.Tensor, scale: float) -> torch.Tensor:
    """The C call: rows of q [B, H, D] over their tables [B, MB] and lengths [B] (int64, contiguous)."""
    attention = getattr(library(), f"paged_attention_{_kernel_suffix(q, kv_cache)}_threads")
    b, h, d = q.shape
    kvh = kv_cache.shape[4]
    q = q.contiguous()
    out = torch.empty_like(q)
    attention(q.data_ptr(), out.data_ptr(), scores.data_ptr(), scale, kv_cache.data_ptr(), tables.data_ptr(),
              lens.data_ptr(), b, tables.shape[1], h, kvh, d, *_cache_geometry(kv_cache, layer), scores.shape[2],
              threads_for(b * kvh, MIN_UNITS_PER_THREAD))
    return out


def threads_for(items: int, min_per_thread: int) -> int:
    """Threads for a C call over `items` independent items: torch's count for the calling thread, fewer
    where a thread would get under `min_per_thread` items (the C side splits them: kernels/cpu/threads.h)."""
    return max(1, min(torch.get_num_threads(), items // min_per_thread))
