"""`pdserve quant-eval`: accuracy, memory and speed of each weight / KV format against FP32, one row each.

A row is a name and a way to build the engine that serves the format (`Row`, `ROWS`): FP32 and
bf16 weights, INT8 per channel (RTN, GPTQ), INT4 at group 128 (RTN, GPTQ, GPTQ with act-order),
the GGUF's own Q4 codes packed for the CPU kernel (`--weight-format int4`, bf16 compute), and FP32
weights with an INT8 or FP8 KV cache; more rows (asymmetric INT8, other group sizes) with `--only`.
Every measurement runs through that engine's own model forward and scheduler
(`pdserve.quant.accuracy` says how each is taken):

- accuracy against the FP32 model of the same file, without a downloaded data set (llama.cpp's
  `perplexity --kl-divergence` method): FP32's own sampled answers to held-out chat prompts,
  teacher-forced over `--positions` positions: mean KL(fp32 || format), top-1 agreement, perplexity;
  and `--tasks` questions with known answers (arithmetic, capitals) asked greedily through the chat
  template, right when a known answer is in the first line;
- bits per projection weight and weight MB as the model holds them, and the RSS of a fresh
  process serving the format (`--rss fresh`; it loads the GPTQ rows from a checkpoint written here);
- decode tokens/s at 1 and 32 streams and the time to first token of a 200-token prompt;
- KV bytes per token from the cache tensor.

GPTQ calibrates on `--calib` (default: `smollm2`, what SmolLM2 writes to calibration prompts
disjoint from the held-out ones; `stories260k` for stories260K), `--calib-samples` rows of
`--calib-seq-len` tokens. `--curve 8 32 128` adds GPTQ INT4 g128's accuracy against the number of
calibration rows. The table in docs/quantization.md comes from
`pdserve quant-eval --json quant-eval.json` on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.commands.output import write_json

NAME = "quant-eval"
HELP = "accuracy (KL, top-1, perplexity, tasks), memory and speed of weight/KV formats vs FP32"

# stories260K prompts: other tests teacher-force them through `sequence_logits`
PROMPTS = (
    "Once upon a time", "Tom had a red ball.", "Lily and her brother Tom went to the park. They saw a big",
    "The little dog was sad because", "One day, a big dog named Max went to the park with his friend",
    "Sam was sad because his toy was broken. His mom said", "The bird flew high",
    "There was a little boat on the lake. It was blue and", "Mom and Dad took Sue to the zoo.",
    "The cat wanted to play with the yarn, but", "Ben found a shiny rock in the garden.", "It was a rainy day.",
)
CONTINUATION = 64
HARNESS_BLOCKS = 512  # KV blocks of each row's engine (held-out generation and tasks run 32 at a time)
RSS_BLOCKS = 32  # KV blocks of the fresh serving process whose RSS is measured (512 tokens)


class RowUnavailable(Exception):
    """This row cannot run on this model (e.g. no Q4 codes in the file); the message says why."""


@dataclass(frozen=True)
class Format:
    """A weight quantization of `quantize_model` (bits 32: the weights as loaded)."""

    name: str
    bits: int
    group_size: int
    method: str
    desc_act: bool = False
    sym: bool = True  # INT8 only: symmetric per channel, or with zero points
    kv_dtype: str = "float32"


# ---- rows ----------------------------------------------------------------------------------------

@dataclass
class Built:
    engine: object  # pdserve.runtime.engine.Engine
    # engine flags of a fresh process serving the row (made only when RSS is measured; None: not measurable)
    serve_flags: Callable[[], list[str]] | None


class RowContext:
    """What rows build from: the FP32 checkpoint, checkpoints in other dtypes, calibration rows, a
    scratch directory for quantized checkpoints. Everything made once and shared between rows."""

    def __init__(self, model_path: Path, fp32, calib: str, calib_samples: int, calib_seq_len: int, tmp: Path) -> None:
        self.model_path, self.fp32, self.tmp = model_path, fp32, tmp
        self.calib_source, self.calib_samples, self.calib_seq_len = calib, calib_samples, calib_seq_len
        self._checkpoints = {"float32": fp32}
        self._calib: dict[int, object] = {}

    def checkpoint(self, dtype: str):
        import torch

        from pdserve.runtime.loader import load_checkpoint

        if dtype not in self._checkpoints:
            self._checkpoints[dtype] = load_checkpoint(self.model_path, getattr(torch, dtype))
        return self._checkpoints[dtype]

    def calibration(self, samples: int | None = None):
        """[n, T] calibration token rows, n <= samples (default: --calib-samples), made at the first
        GPTQ row; the first n rows of a larger set are the rows of a smaller one."""
        from pdserve.quant.calibration import load_texts, token_chunks

        n = samples or self.calib_samples
        if n not in self._calib:
            self._calib[n] = token_chunks(self.fp32.tokenizer, load_texts(self.calib_source), self.calib_seq_len, n)
        return self._calib[n]

    def engine(self, checkpoint, dtype: str = "float32", kv_dtype: str = "float32", weight_format: str = "dense",
               weights: dict | None = None, variant: str = ""):
        """An engine on `checkpoint` (or on `weights`, a quantized dict of it named `variant`: its
        own fingerprint, as a quantized checkpoint has)."""
        import hashlib

        from pdserve.runtime.config import CacheConfig, EngineConfig
        from pdserve.runtime.engine import Engine

        config = EngineConfig(cache=CacheConfig(num_blocks=HARNESS_BLOCKS, dtype=kv_dtype), dtype=dtype,
                              weight_format=weight_format)
        if weights is None:
            return Engine.from_checkpoint(checkpoint, config)
        fingerprint = hashlib.blake2b(f"{checkpoint.fingerprint}/{variant}".encode(), digest_size=16).hexdigest()
        return Engine(checkpoint.config, weights, fingerprint, config, tokenizer=checkpoint.tokenizer)

    def flags(self, model: Path | None = None, dtype: str = "float32", kv_dtype: str = "float32",
              weight_format: str = "dense") -> list[str]:
        return ["--model", str(model or self.model_path), "--dtype", dtype, "--kv-dtype", kv_dtype,
                "--weight-format", weight_format, "--num-blocks", str(RSS_BLOCKS)]


def float_row(dtype: str, kv_dtype: str | None = None) -> Callable[[RowContext], Built]:
    """The file's weights in `dtype` (dense), KV in `kv_dtype` (default: the same dtype)."""
    def build(ctx: RowContext) -> Built:
        kv = kv_dtype or dtype
        return Built(ctx.engine(ctx.checkpoint(dtype), dtype, kv), lambda: ctx.flags(dtype=dtype, kv_dtype=kv))
    return build


def gguf_int4_row(ctx: RowContext) -> Built:
    """The GGUF's own Q4_0/Q4_1 codes packed for torch's CPU int4 kernel, bf16 activations."""
    from pdserve.quant.int4_cpu import read_gguf_codes

    fp32 = ctx.fp32
    if fp32.source.suffix != ".gguf":
        raise RowUnavailable("not a GGUF file")
    names = fp32.config.arch.projection_names(fp32.config)
    codes = read_gguf_codes(fp32.source, {fp32.config.arch.to_gguf(n): n for n in names})
    if len(codes) < len(names):
        raise RowUnavailable(f"{len(names) - len(codes)} of {len(names)} projections are not Q4_0/Q4_1 in the file")
    engine = ctx.engine(ctx.checkpoint("bfloat16"), "bfloat16", "bfloat16", "int4")
    return Built(engine, lambda: ctx.flags(dtype="bfloat16", kv_dtype="bfloat16", weight_format="int4"))


def quantized_row(fmt: Format) -> Callable[[RowContext], Built]:
    """`quantize_model` of the FP32 weights; the fresh serving process loads the checkpoint
    `pdserve quantize` would write (saved here)."""
    def build(ctx: RowContext) -> Built:
        weights = quantized_weights(ctx.fp32, fmt, ctx.calibration() if fmt.method == "gptq" else None)
        engine = ctx.engine(ctx.fp32, kv_dtype=fmt.kv_dtype, weights=weights, variant=fmt.name)
        return Built(engine, lambda: ctx.flags(model=save_checkpoint(ctx, fmt, weights), kv_dtype=fmt.kv_dtype))
    return build


def save_checkpoint(ctx: RowContext, fmt: Format, weights: dict) -> Path:
    from pdserve.quant.checkpoint import quantization_config, save_quantized
    from pdserve.quant.spec import QuantSpec

    spec = QuantSpec(fmt.bits, fmt.group_size, sym=fmt.bits == 8 and fmt.sym, desc_act=fmt.desc_act)
    qconfig = quantization_config(spec, fmt.method, 0.01, {"source": ctx.fp32.source.name,
                                                           "created_by": "pdserve quant-eval"})
    return save_quantized(ctx.tmp / fmt.name, ctx.fp32, weights, qconfig)


@dataclass(frozen=True)
class Row:
    name: str
    weights: str  # the projections, for the table
    kv: str
    build: Callable[[RowContext], Built]
    default: bool = True  # in the table without --only


def _q(name: str, weights: str, fmt: Format, default: bool = True) -> Row:
    return Row(name, weights, "fp32" if fmt.kv_dtype == "float32" else fmt.kv_dtype, quantized_row(fmt), default)


ROWS: tuple[Row, ...] = (
    Row("fp32", "fp32", "fp32", float_row("float32")),
    Row("bf16", "bf16", "bf16", float_row("bfloat16")),
    _q("int8", "int8 sym RTN, per channel", Format("int8", 8, -1, "rtn")),
    _q("int8-gptq", "int8 sym GPTQ, per channel", Format("int8-gptq", 8, -1, "gptq")),
    _q("int4-rtn-g128", "int4 RTN g128", Format("int4-rtn-g128", 4, 128, "rtn")),
    _q("int4-gptq-g128", "int4 GPTQ g128", Format("int4-gptq-g128", 4, 128, "gptq")),
    _q("int4-gptq-act-g128", "int4 GPTQ act-order g128", Format("int4-gptq-act-g128", 4, 128, "gptq", True)),
    Row("int4-gguf", "GGUF Q4 codes packed, bf16", "bf16", gguf_int4_row),
    Row("kv-int8", "fp32", "int8", float_row("float32", "int8")),
    Row("kv-fp8", "fp32", "fp8_e4m3", float_row("float32", "fp8_e4m3")),
    # more rows, with --only
    _q("int8-asym", "int8 asym RTN, per channel", Format("int8-asym", 8, -1, "rtn", sym=False), False),
    _q("int8-asym-gptq", "int8 asym GPTQ, per channel", Format("int8-asym-gptq", 8, -1, "gptq", sym=False), False),
    _q("int8+kv-int8", "int8 sym RTN, per channel", Format("int8+kv-int8", 8, -1, "rtn", kv_dtype="int8"), False),
    *(_q(f"int4-{m}-g{g}", f"int4 {m.upper()} g{g}", Format(f"int4-{m}-g{g}", 4, g, m), False)
      for g in (32, 64) for m in ("rtn", "gptq")),
)


def registry() -> dict[str, Row]:
    """Every row by name: ours, then those of other quantization modules that are importable."""
    return {r.name: r for r in ROWS + extra_rows()}


def extra_rows() -> tuple[Row, ...]:
    """Rows of formats other modules add (W8A8 / dynamic INT8 / mixed INT4-INT8 in
    `pdserve.quant.int8_bench`, QAT in `pdserve.quant.qat`), when they import: `--only` picks them."""
    rows: list[Row] = []
    try:
        from pdserve.quant.int8_bench import FORMATS, build_format
    except ImportError:
        FORMATS = ()
    ours = {r.name for r in ROWS}
    for name in FORMATS:
        if name not in ours and name != "int8-w8a16":  # that one is our int8 row
            rows.append(Row(name, name, "fp32", weights_row(name, lambda ctx, n=name: build_format(
                n, ctx.fp32, ctx.calibration())), default=False))
    try:
        from pdserve.quant.qat import QATConfig, qat_quantize
    except ImportError:
        return tuple(rows)
    from pdserve.quant.spec import QuantSpec

    def qat(ctx: RowContext) -> dict:
        return qat_quantize(ctx.fp32, QATConfig(spec=QuantSpec(4, 128, sym=False))).weights
    rows.append(Row("int4-qat-g128", "int4 QAT g128 (100 steps)", "fp32", weights_row("int4-qat-g128", qat),
                    default=False))
    return tuple(rows)


def weights_row(name: str, make: Callable[[RowContext], dict]) -> Callable[[RowContext], Built]:
    """A row from a function making the weight dict (RSS not measured: no checkpoint is written)."""
    def build(ctx: RowContext) -> Built:
        return Built(ctx.engine(ctx.fp32, weights=make(ctx), variant=name), None)
    return build


def select_rows(only: list[str] | None) -> list[Row]:
    """The default rows, or `only` (fp32 first either way: it is the reference)."""
    from pdserve.quant.spec import QuantError

    rows = registry()
    if not only:
        return [r for r in rows.values() if r.default]
    unknown = [n for n in only if n not in rows]
    if unknown:
        raise QuantError(f"--only: unknown row(s) {', '.join(unknown)} (known: {', '.join(rows)})")
    return [rows["fp32"]] + [rows[n] for n in dict.fromkeys(only) if n != "fp32"]


# ---- the run -------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    weights: str
    kv: str
    bits_per_weight: float  # decoder projections as held by the model (scales, zeros, packings in)
    weight_mb: float  # every weight as held by the model (embedding, head once if tied, norms)
    rss_mb: float | None  # VmRSS of a fresh process serving the row after one request
    rss_model_mb: float | None  # the same less that process's RSS before loading (imports)
    kl: float
    top1: float
    ppl: float
    ppl_delta_pct: float
    positions: int
    task_score: float
    tokens_per_s_1: float
    tokens_per_s_32: float
    ttft_200_s: float
    kv_bytes_per_token: float
    kv_wire_bytes_per_token: float | None  # --kv-transfer: encoded blocks per token
    kv_transfer_s: float | None  # --kv-transfer: a 200-token prompt's KV through a KV store and back
    build_s: float  # quantization / loading
    row_s: float  # the whole row, fresh-process RSS included
    skipped: str = ""  # why the row did not run


@dataclass(frozen=True)
class Suite:
    """The fixed inputs every row is measured on."""

    reference: object  # accuracy.Reference
    tasks: list
    positions: int


def build_suite(ref_engine, tokenizer, args: argparse.Namespace) -> Suite:
    from pdserve.quant import accuracy
    from pdserve.quant.calibration import load_prompts

    prompts = load_prompts(accuracy.HELDOUT_PROMPTS)
    seqs = accuracy.heldout_sequences(ref_engine, tokenizer, prompts, args.positions, args.answer_tokens)
    return Suite(accuracy.Reference(ref_engine, seqs), accuracy.load_tasks()[:args.tasks], args.positions)


def measure_row(row: Row, ctx: RowContext, suite: Suite, args: argparse.Namespace, log,
                built: Built | None = None) -> Result:
    """The row's result (`built`: its engine, when the reference already built it)."""
    from pdserve.quant import accuracy
    from pdserve.runtime.kv_cache import kv_bytes_per_token

    start = time.perf_counter()
    built = built or row.build(ctx)
    build_s = time.perf_counter() - start
    engine = built.engine
    agreement = suite.reference.compare(engine)
    log(f"{row.name}: built in {build_s:.1f} s, KL {agreement.kl:.5f}, top-1 {100 * agreement.top1:.2f} %")
    tasks = accuracy.task_score(engine, ctx.fp32.tokenizer, suite.tasks) if suite.tasks else None
    speed = accuracy.measure_speed(engine, rounds=args.speed_rounds)
    wire = accuracy.kv_transfer(engine) if args.kv_transfer else None
    rss = accuracy.serving_rss(built.serve_flags() + thread_flags(args)) \
        if args.rss == "fresh" and built.serve_flags else None
    model = engine.runner.model
    return Result(
        row.name, row.weights, row.kv, accuracy.projection_bits(model), accuracy.weight_bytes(model) / 1e6,
        rss and rss["rss"] / 1e6, rss and (rss["rss"] - rss["rss_before_load"]) / 1e6,
        agreement.kl, agreement.top1, agreement.ppl, 0.0, agreement.positions,
        tasks.score if tasks else float("nan"), speed.tokens_per_s_1, speed.tokens_per_s_32, speed.ttft_200_s,
        kv_bytes_per_token(engine.kv_cache), wire and wire.wire_bytes_per_token, wire and wire.seconds, build_s,
        time.perf_counter() - start)


def thread_flags(args: argparse.Namespace) -> list[str]:
    return ["--threads", str(args.threads)] if args.threads else []


def skipped(row: Row, why: str) -> Result:
    nan = float("nan")
    return Result(row.name, row.weights, row.kv, nan, nan, None, None, nan, nan, nan, nan, 0, nan, nan, nan, nan,
                  nan, None, None, 0.0, 0.0, why)


def evaluate(ctx: RowContext, rows: list[Row], args: argparse.Namespace, log=print) -> tuple[list[Result], list]:
    """(one Result per row, the calibration curve): the fp32 row's engine is the reference."""
    results: list[Result] = []
    start = time.perf_counter()
    ref_built = rows[0].build(ctx)
    suite = build_suite(ref_built.engine, ctx.fp32.tokenizer, args)
    log(f"held-out: {suite.positions} positions, tasks: {len(suite.tasks)} ({time.perf_counter() - start:.0f} s)")
    for row in rows:
        built, ref_built = ref_built, None  # the reference's engine serves as the fp32 row, then goes
        try:
            result = measure_row(row, ctx, suite, args, log, built)
        except RowUnavailable as e:
            log(f"{row.name}: skipped ({e})")
            results.append(skipped(row, str(e)))
            continue
        built = None
        gc.collect()  # the row's engine (its KV cache, quantized weights) before the next one
        result.ppl_delta_pct = 100 * (result.ppl / results[0].ppl - 1) if results else 0.0
        results.append(result)
        log(f"{row.name}: done in {result.row_s:.1f} s")
    curve = calibration_curve(ctx, suite, args.curve, log) if args.curve else []
    return results, curve


@dataclass
class CurvePoint:
    samples: int  # calibration rows of calib_seq_len tokens
    kl: float
    top1: float
    ppl: float
    quantize_s: float


def calibration_curve(ctx: RowContext, suite: Suite, samples: list[int], log) -> list[CurvePoint]:
    """GPTQ INT4 g128 against the number of calibration rows (the first n rows of the same set)."""
    fmt = Format("int4-gptq-g128", 4, 128, "gptq")
    rows = ctx.calibration(max(samples))
    points = []
    for n in samples:
        start = time.perf_counter()
        weights = quantized_weights(ctx.fp32, fmt, rows[:n])
        quantize_s = time.perf_counter() - start
        a = suite.reference.compare(ctx.engine(ctx.fp32, weights=weights, variant=f"curve-{n}"))
        points.append(CurvePoint(min(n, len(rows)), a.kl, a.top1, a.ppl, quantize_s))
        log(f"curve: {n} rows, KL {a.kl:.5f}, top-1 {100 * a.top1:.2f} % ({quantize_s:.0f} s)")
    return points


# ---- stories260K-era helpers other tests use -----------------------------------------------------

def quantized_weights(checkpoint, fmt: Format, calib):
    from pdserve.quant.layerwise import quantize_model
    from pdserve.quant.spec import QuantSpec

    if fmt.bits == 32:
        return checkpoint.weights
    spec = QuantSpec(fmt.bits, fmt.group_size, sym=fmt.bits == 8 and fmt.sym, desc_act=fmt.desc_act)
    return quantize_model(checkpoint.config, checkpoint.weights, spec, fmt.method,
                          calib if fmt.method == "gptq" else None)


def sequence_logits(model, ids: list[int], block_size: int = 16, kv_dtype: str = "float32"):
    """All-position logits [T, V] of one sequence through the runtime forward, on a private cache
    in the KV format `kv_dtype` (every position attends to the stored, possibly quantized, KV)."""
    import torch

    from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
    from pdserve.runtime.config import CacheConfig
    from pdserve.runtime.kv_cache import allocate_kv_cache

    t = len(ids)
    blocks = -(-t // block_size)
    kv = allocate_kv_cache(model.config, CacheConfig(block_size=block_size, num_blocks=blocks, dtype=kv_dtype),
                           "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(t), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
                             decode_context_lens=torch.zeros(0, dtype=torch.long),
                             prefills=(PrefillSpan(0, t, t, torch.arange(blocks)),))
    hidden = model.forward(torch.tensor(ids), torch.arange(t), meta, kv)
    return model.compute_logits(hidden)


def kl_and_top1(ref: list, got: list) -> tuple[float, float]:
    """Mean KL(ref || got) over all positions of lists of [T, V] logits, and the argmax agreement."""
    import torch

    from pdserve.quant.accuracy import AgreementSum

    acc = AgreementSum()
    for r, g in zip(ref, got):
        acc.add(r, g, torch.zeros(r.shape[0], dtype=torch.long))
    a = acc.result()
    return a.kl, a.top1


# ---- the command ---------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_model_args

    add_model_args(p)
    p.add_argument("--only", nargs="+", default=None, metavar="ROW",
                   help="run only these rows (fp32, the reference, always runs); names as in the table, "
                        "plus int8-asym, int8-asym-gptq, int8+kv-int8, int4-{rtn,gptq}-g{32,64}")
    p.add_argument("--positions", type=int, default=2048, help="teacher-forced positions of held-out text")
    p.add_argument("--answer-tokens", type=int, default=96, help="longest held-out answer sampled from FP32")
    p.add_argument("--tasks", type=int, default=50, help="questions with known answers to ask (at most 50)")
    p.add_argument("--calib", "--calibration", dest="calib", default=None,
                   help="GPTQ calibration: builtin set (smollm2, stories260k) or a file (JSON lines with 'text', "
                        "or blank-line-separated text); default: stories260k for stories260K, else smollm2")
    p.add_argument("--calib-samples", type=int, default=None,
                   help="calibration rows (default: 32 for SmolLM2 and other models, 128 for stories260K)")
    p.add_argument("--calib-seq-len", type=int, default=128)
    p.add_argument("--curve", type=int, nargs="*", default=[], metavar="N",
                   help="also GPTQ INT4 g128's accuracy with N calibration rows, for each N (e.g. 8 32 128)")
    p.add_argument("--rss", choices=("fresh", "none"), default="fresh",
                   help="fresh: RSS of a new process serving each row (a few seconds per row); none: skip")
    p.add_argument("--kv-transfer", action="store_true",
                   help="also time a 200-token prompt's KV blocks through a KV store on loopback and back")
    p.add_argument("--speed-rounds", type=int, default=2, help="best of this many rounds of each speed figure")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path ('-': stdout)")


def is_stories(checkpoint) -> bool:
    return checkpoint.source.name.startswith("stories260K")


def fmt_or_dash(value: float | None, spec: str) -> str:
    import math

    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(results: list[Result]) -> None:
    head = (f"{'format':<20}{'bits/w':>7}{'wt MB':>8}{'RSS MB':>8}{'KL':>9}{'top-1':>8}{'ppl':>8}{'Δppl':>8}"
            f"{'tasks':>7}{'tok/s 1':>8}{'tok/s 32':>9}{'TTFT s':>7}{'KV B/tok':>9}{'row s':>7}")
    print(head)
    for r in results:
        if r.skipped:
            print(f"{r.name:<20} skipped: {r.skipped}")
            continue
        print(f"{r.name:<20}{r.bits_per_weight:>7.2f}{r.weight_mb:>8.1f}{fmt_or_dash(r.rss_mb, '.0f'):>8}"
              f"{r.kl:>9.5f}{100 * r.top1:>7.2f}%{r.ppl:>8.3f}{r.ppl_delta_pct:>+7.2f}%{100 * r.task_score:>6.0f}%"
              f"{r.tokens_per_s_1:>8.1f}{r.tokens_per_s_32:>9.1f}{r.ttft_200_s:>7.2f}{r.kv_bytes_per_token:>9.0f}"
              f"{r.row_s:>7.0f}" + (f"  wire {r.kv_wire_bytes_per_token:.0f} B/tok, {1e3 * r.kv_transfer_s:.1f} ms"
                                    if r.kv_transfer_s is not None else ""))


def print_curve(points: list[CurvePoint], seq_len: int) -> None:
    print(f"\nGPTQ int4 g128 vs calibration rows of {seq_len} tokens")
    print(f"{'rows':>6}{'KL':>9}{'top-1':>8}{'ppl':>8}{'quant s':>8}")
    for p in points:
        print(f"{p.samples:>6}{p.kl:>9.5f}{100 * p.top1:>7.2f}%{p.ppl:>8.3f}{p.quantize_s:>8.0f}")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.quant.spec import QuantError
    from pdserve.runtime.loader import ModelLoadError, load_checkpoint, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        rows = select_rows(args.only)
        path = resolve_model_path(args.model)
        fp32 = load_checkpoint(path)
        stories = is_stories(fp32)
        calib = args.calib or ("stories260k" if stories else "smollm2")
        samples = args.calib_samples or (128 if stories else 32)
        with tempfile.TemporaryDirectory(prefix="quant-eval-") as tmp:
            ctx = RowContext(path, fp32, calib, samples, args.calib_seq_len, Path(tmp))
            results, curve = evaluate(ctx, rows, args, log=lambda m: print(m, file=sys.stderr, flush=True))
    except (QuantError, ModelLoadError) as e:
        print(f"pdserve quant-eval: error: {e}", file=sys.stderr)
        return 2
    print_table(results)
    if curve:
        print_curve(curve, args.calib_seq_len)
    total_s = time.perf_counter() - started
    print(f"\n{len(results)} rows in {total_s:.0f} s; calibration: {calib}, {samples} rows of {args.calib_seq_len}")
    if args.json:
        write_json(args.json, {"model": str(fp32.source), "positions": args.positions, "tasks": args.tasks,
                               "calibration": {"set": calib, "rows": samples, "seq_len": args.calib_seq_len},
                               "threads": torch.get_num_threads(), "total_s": total_s,
                               "formats": [asdict(r) for r in results], "curve": [asdict(p) for p in curve]})
    return 0
