"""`pdserve quant-eval`: accuracy, memory and speed of each weight / KV format against FP32, one row each.

A row is a format as a user makes and serves it (`pdserve.quant.eval_rows`): the command that
writes its model (`pdserve quantize`, `pdserve qat`, a GGUF re-encoded, or the source file) and the
flags `pdserve up` serves it with. Default rows: FP32 and bf16 weights, INT8 per channel (RTN,
GPTQ), INT4 at group 128 (RTN, GPTQ, GPTQ with act-order), the GGUF's own Q4 codes and a Q8_0
re-encoding served packed, dynamic and static W8A8, INT4 MLP with INT8 attention, QAT INT4, and FP32
weights with an INT8 or FP8 KV cache; more with `--only`.
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
from pdserve.quant.eval_rows import (QAT_STEPS, ROWS, RSS_BLOCKS, Row, RowContext, RowUnavailable, build_engine, curve_row,
                                     select_rows)

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


@dataclass
class Result:
    name: str
    weights: str
    kv: str
    weight_format: str  # what the served engine's projections are (dense, int4, packed)
    recipe: str  # the command that made the model ("" : the source file)
    serve: str  # the engine flags it is served with, after --model
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
    make_s: float  # making the model (quantization, QAT, re-encoding; 0 for the source file)
    build_s: float  # making and loading
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
                engine=None) -> Result:
    """The row's result (`engine`: its engine, when the reference already built it)."""
    from pdserve.quant import accuracy
    from pdserve.runtime.kv_cache import kv_bytes_per_token

    start = time.perf_counter()
    model_path, make_s = row.model(ctx)
    engine = engine or build_engine(row.flags(model_path))
    build_s = time.perf_counter() - start
    agreement = suite.reference.compare(engine)
    log(f"{row.name}: built in {build_s:.1f} s ({make_s:.1f} s making the model), KL {agreement.kl:.5f}, "
        f"top-1 {100 * agreement.top1:.2f} %")
    tasks = accuracy.task_score(engine, ctx.fp32.tokenizer, suite.tasks) if suite.tasks else None
    speed = accuracy.measure_speed(engine, rounds=args.speed_rounds)
    wire = accuracy.kv_transfer(engine) if args.kv_transfer else None
    rss = accuracy.serving_rss(row.flags(model_path, RSS_BLOCKS) + thread_flags(args)) if args.rss == "fresh" else None
    model = engine.runner.model
    return Result(
        row.name, row.weights, row.kv, engine.weight_format, " ".join(row.recipe), " ".join(row.serve),
        accuracy.projection_bits(model), accuracy.weight_bytes(model) / 1e6,
        rss and rss["rss"] / 1e6, rss and (rss["rss"] - rss["rss_before_load"]) / 1e6,
        agreement.kl, agreement.top1, agreement.ppl, 0.0, agreement.positions,
        tasks.score if tasks else float("nan"), speed.tokens_per_s_1, speed.tokens_per_s_32, speed.ttft_200_s,
        kv_bytes_per_token(engine.kv_cache), wire and wire.wire_bytes_per_token, wire and wire.seconds, make_s,
        build_s, time.perf_counter() - start)


def thread_flags(args: argparse.Namespace) -> list[str]:
    return ["--threads", str(args.threads)] if args.threads else []


def skipped(row: Row, why: str) -> Result:
    nan = float("nan")
    return Result(row.name, row.weights, row.kv, "", " ".join(row.recipe), " ".join(row.serve), nan, nan, None,
                  None, nan, nan, nan, nan, 0, nan, nan, nan, nan, nan, None, None, 0.0, 0.0, 0.0, why)


def evaluate(ctx: RowContext, rows: list[Row], args: argparse.Namespace, log=print) -> tuple[list[Result], list]:
    """(one Result per row, the calibration curve): the fp32 row's engine is the reference."""
    results: list[Result] = []
    start = time.perf_counter()
    ref_engine = build_engine(rows[0].flags(ctx.model_path))
    suite = build_suite(ref_engine, ctx.fp32.tokenizer, args)
    log(f"held-out: {suite.positions} positions, tasks: {len(suite.tasks)} ({time.perf_counter() - start:.0f} s)")
    for row in rows:
        engine, ref_engine = ref_engine, None  # the reference's engine serves as the fp32 row, then goes
        try:
            result = measure_row(row, ctx, suite, args, log, engine)
        except RowUnavailable as e:
            log(f"{row.name}: skipped ({e})")
            results.append(skipped(row, str(e)))
            continue
        engine = None
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
    """GPTQ INT4 g128 against the number of calibration rows (the first n rows of the same set),
    each served as the table's int4-gptq-g128 row is."""
    points = []
    for n in samples:
        row = curve_row(n)
        model_path, quantize_s = row.model(ctx)
        a = suite.reference.compare(build_engine(row.flags(model_path)))
        points.append(CurvePoint(n, a.kl, a.top1, a.ppl, quantize_s))
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


def sequence_logits(model, ids: list[int], block_size: int = 16, kv_dtype: str = "float32",
                    generated: bool | None = None):
    """All-position logits [T, V] of one sequence through the runtime forward, on a private cache
    in the KV format `kv_dtype` (every position attends to the stored, possibly quantized, KV).
    `generated` True / False: every row computed as a generated token's (4-bit projections on their
    int8-input kernels, as decode steps run them) / a prompt's; None: the projections choose by count."""
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
                             prefills=(PrefillSpan(0, t, t, torch.arange(blocks)),),
                             generated_rows=None if generated is None else torch.full((t,), generated))
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
                   help="run only these rows (fp32, the reference, always runs): the table's, or "
                        + ", ".join(r.name for r in ROWS if not r.default))
    p.add_argument("--qat-steps", type=int, default=QAT_STEPS, help="optimiser steps of the int4-qat-g128 row")
    p.add_argument("--prebuilt", nargs="+", default=[], metavar="ROW=PATH",
                   help="serve PATH as ROW's model instead of making it (e.g. int4-qat-g128=DIR written by "
                        "`pdserve qat`, or your own checkpoint in a row's format); make_s is then 0")
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


def prebuilt_models(pairs: list[str], rows: list[Row]) -> dict[str, Path]:
    """--prebuilt ROW=PATH ... as {row name: path}; a row not being run or a missing path is an error."""
    from pdserve.quant.spec import QuantError

    names, out = {r.name for r in rows}, {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or name not in names:
            raise QuantError(f"--prebuilt {pair!r}: want ROW=PATH with ROW one of the rows run ({', '.join(names)})")
        if not Path(path).expanduser().exists():
            raise QuantError(f"--prebuilt {pair!r}: {path} does not exist")
        out[name] = Path(path).expanduser()
    return out


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
            ctx = RowContext(path, fp32, calib, samples, args.calib_seq_len, Path(tmp), args.qat_steps,
                             prebuilt_models(args.prebuilt, rows))
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
