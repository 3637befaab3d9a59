"""The rows of `pdserve quant-eval`: each a format as a user makes and serves it.

A row is the command that makes its model (`pdserve quantize ...`, `pdserve qat ...`, a GGUF
re-encoded in another block type, or nothing: the source file itself) and the engine flags it is
served with (`pdserve up --model OUT <flags>`). The engine every measurement runs on is built from
those flags by `engine_args.build_engine`, as a worker builds its own, from the checkpoint the
command wrote, so a row's figures are those of the served format, not of an in-process stand-in;
the fresh process whose RSS is measured gets the same flags.

GPTQ-format checkpoints (INT8, INT4, mixed, QAT) are served with bf16 activations: on the CPU that
routes them to torch's int4 kernel (8-bit codes as two 4-bit planes, `pdserve.quant.gptq_cpu`).
With fp32 activations they would run `QuantLinear`, which dequantizes every matrix on every call
(the `-fp32` rows, with --only, measure that).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

HARNESS_BLOCKS = 512  # KV blocks of each row's engine (held-out generation and tasks run 32 at a time)
RSS_BLOCKS = 32  # KV blocks of the fresh serving process whose RSS is measured (512 tokens)
QAT_STEPS = 100  # optimiser steps of the QAT row (`pdserve qat --steps`)


class RowUnavailable(Exception):
    """This row cannot run on this model (e.g. no Q4 codes in the file); the message says why."""


class RowContext:
    """What rows are made from: the source model, its FP32 checkpoint (the reference; the tokenizer),
    the calibration flags every GPTQ / static-W8A8 row shares, and a scratch directory for the
    models the rows' commands write. A model is made once per (row, variant) and reused."""

    def __init__(self, model_path: Path, fp32, calib: str, calib_samples: int, calib_seq_len: int, tmp: Path,
                 qat_steps: int = QAT_STEPS, prebuilt: dict[str, Path] | None = None) -> None:
        self.model_path, self.fp32, self.tmp = model_path, fp32, tmp
        self.calib_source, self.calib_samples, self.calib_seq_len = calib, calib_samples, calib_seq_len
        self.qat_steps = qat_steps
        # models made before this run (--prebuilt ROW=PATH): served as they are, nothing is made
        self._made: dict[str, tuple[Path, float]] = {k: (p, 0.0) for k, p in (prebuilt or {}).items()}

    def calib_flags(self, samples: int | None = None) -> list[str]:
        return ["--calib", self.calib_source, "--calib-samples", str(samples or self.calib_samples),
                "--calib-seq-len", str(self.calib_seq_len)]

    def made(self, key: str, make: Callable[[Path], Path]) -> tuple[Path, float]:
        """(the model `make` writes under tmp/key, seconds it took), made at the first call."""
        if key not in self._made:
            start = time.perf_counter()
            path = make(self.tmp / key)
            self._made[key] = (path, time.perf_counter() - start)
        return self._made[key]


# A row's maker: (context, key) -> (model path, seconds spent making it; 0 for the source file).
Maker = Callable[[RowContext, str], tuple[Path, float]]


@dataclass(frozen=True)
class Row:
    name: str
    weights: str  # what the weights are, for the table
    kv: str
    serve: tuple[str, ...]  # engine flags after --model (dtype, weight format, KV format)
    make: Maker | None = None  # None: the source file as it is
    default: bool = True  # in the table without --only
    recipe: tuple[str, ...] = field(default=())  # the command line that makes the model, for the JSON

    def model(self, ctx: RowContext) -> tuple[Path, float]:
        """(the row's model, seconds spent making it in this run)."""
        if self.make is None:
            return ctx.made(self.name, lambda _: ctx.model_path)[0], 0.0  # the source, or --prebuilt
        return self.make(ctx, self.name)

    def flags(self, model: Path, num_blocks: int = HARNESS_BLOCKS) -> list[str]:
        return ["--model", str(model), *self.serve, "--num-blocks", str(num_blocks)]


def build_engine(flags: list[str]):
    """The engine a worker started with `flags` serves (the checkpoint dropped, as a worker does)."""
    from pdserve.engine_args import add_engine_args, build_engine as build

    p = argparse.ArgumentParser()
    add_engine_args(p)
    engine, _ = build(p.parse_args(flags), set_threads=False)
    return engine


# ---- makers --------------------------------------------------------------------------------------

def quantize(*argv: str, calibrated: bool = False) -> Maker:
    """`pdserve quantize ARGV --model SOURCE --out DIR` (with the shared calibration flags when
    `calibrated`: GPTQ and static W8A8)."""
    def make(ctx: RowContext, key: str, samples: int | None = None) -> tuple[Path, float]:
        calib = ctx.calib_flags(samples) if calibrated else []
        if samples not in (None, ctx.calib_samples):
            key = f"{key}-calib{samples}"
        return ctx.made(key, lambda out: _run_quantize([*argv, *calib, "--model", str(ctx.model_path),
                                                        "--out", str(out)]))
    return make


def _run_quantize(argv: list[str]) -> Path:
    from pdserve.commands import quantize as command

    p = argparse.ArgumentParser(prog="pdserve quantize")
    command.add_arguments(p)
    return command._quantize(p.parse_args(argv))


def qat(bits: int, group_size: int) -> Maker:
    """`pdserve qat --bits B --group-size G --steps <ctx.qat_steps> --out DIR`."""
    def make(ctx: RowContext, key: str) -> tuple[Path, float]:
        return ctx.made(key, lambda out: _run_qat(ctx, bits, group_size, out))
    return make


def _run_qat(ctx: RowContext, bits: int, group_size: int, out: Path) -> Path:
    from pdserve.quant.qat import QATConfig, qat_quantize, save_qat_checkpoint
    from pdserve.quant.spec import check_quantize_request

    spec = check_quantize_request(bits, group_size, "rtn", False)
    result = qat_quantize(ctx.fp32, QATConfig(spec, steps=ctx.qat_steps))
    return save_qat_checkpoint(out, ctx.fp32, result)


def gguf_as(type_name: str) -> Maker:
    """The source GGUF with its projections re-encoded as `type_name` (pdserve.quant.gguf_requant)."""
    def make(ctx: RowContext, key: str) -> tuple[Path, float]:
        from pdserve.quant.gguf_requant import requantize_gguf

        if ctx.model_path.suffix != ".gguf":
            raise RowUnavailable("not a GGUF file")
        return ctx.made(key, lambda out: requantize_gguf(ctx.model_path, out.with_suffix(".gguf"), type_name))
    return make


def gguf_q4_codes(ctx: RowContext, key: str) -> tuple[Path, float]:
    """The source itself, when its projections are Q4_0/Q4_1 (what `--weight-format int4` serves as they are)."""
    from pdserve.quant.int4_codes import read_gguf_codes

    fp32 = ctx.fp32
    if fp32.source.suffix != ".gguf":
        raise RowUnavailable("not a GGUF file")
    names = fp32.config.arch.projection_names(fp32.config)
    codes = read_gguf_codes(fp32.source, {fp32.config.arch.to_gguf(n): n for n in names})
    if len(codes) < len(names):
        raise RowUnavailable(f"{len(names) - len(codes)} of {len(names)} projections are not Q4_0/Q4_1 in the file")
    return ctx.model_path, 0.0


# ---- the table -----------------------------------------------------------------------------------

FP32 = ("--dtype", "float32", "--weight-format", "dense")
BF16 = ("--dtype", "bfloat16", "--weight-format", "dense")
GPTQ_SERVED = ("--dtype", "bfloat16", "--weight-format", "auto")  # int4 kernel / 8-bit planes
GPTQ_FP32 = ("--dtype", "float32", "--weight-format", "auto")  # QuantLinear: dequantized every call


def _q(name: str, weights: str, argv: tuple[str, ...], serve=GPTQ_SERVED, default: bool = True) -> Row:
    calibrated = "gptq" in argv or "w8a8" in argv
    return Row(name, weights, "bf16" if serve[1] == "bfloat16" else "fp32", serve,
               quantize(*argv, calibrated=calibrated), default, ("pdserve quantize", *argv))


INT4_G128 = ("--bits", "4", "--group-size", "128")
ROWS: tuple[Row, ...] = (
    Row("fp32", "fp32", "fp32", FP32),
    Row("bf16", "bf16", "bf16", BF16),
    _q("int8", "int8 sym RTN, per channel", ("--method", "rtn", "--bits", "8")),
    _q("int8-gptq", "int8 sym GPTQ, per channel", ("--method", "gptq", "--bits", "8")),
    _q("int4-rtn-g128", "int4 RTN g128", ("--method", "rtn", *INT4_G128)),
    _q("int4-gptq-g128", "int4 GPTQ g128", ("--method", "gptq", *INT4_G128)),
    _q("int4-gptq-act-g128", "int4 GPTQ act-order g128", ("--method", "gptq", *INT4_G128, "--desc-act")),
    Row("int4-gguf", "GGUF Q4 codes packed", "bf16", ("--dtype", "bfloat16", "--weight-format", "int4"),
        gguf_q4_codes),
    Row("q8_0-gguf", "GGUF Q8_0 codes packed", "bf16", ("--dtype", "bfloat16", "--weight-format", "packed"),
        gguf_as("Q8_0"), recipe=("requantize_gguf", "Q8_0")),
    _q("dynamic-int8", "W8A8, activations per token", ("--method", "dynamic-int8"), FP32),
    _q("w8a8-minmax", "W8A8 static, min-max", ("--method", "w8a8", "--observer", "minmax"), FP32),
    _q("mixed-gptq-attn8", "INT4 GPTQ MLP, INT8 attn", ("--method", "gptq", *INT4_G128, "--attention-bits", "8")),
    Row("int4-qat-g128", "int4 QAT g128", "bf16", GPTQ_SERVED, qat(4, 128), recipe=("pdserve qat", *INT4_G128)),
    Row("kv-int8", "fp32", "int8", (*FP32, "--kv-dtype", "int8")),
    Row("kv-fp8", "fp32", "fp8_e4m3", (*FP32, "--kv-dtype", "fp8_e4m3")),
    # more rows, with --only
    _q("int8-asym", "int8 asym RTN, per channel", ("--method", "rtn", "--bits", "8", "--asym"), default=False),
    _q("int8-asym-gptq", "int8 asym GPTQ, per channel", ("--method", "gptq", "--bits", "8", "--asym"), default=False),
    _q("w8a8-percentile", "W8A8 static, percentile", ("--method", "w8a8", "--observer", "percentile"), FP32,
       default=False),
    _q("mixed-rtn-attn8", "INT4 RTN MLP, INT8 attn", ("--method", "rtn", *INT4_G128, "--attention-bits", "8"),
       default=False),
    _q("mixed-gptq-attn16", "INT4 GPTQ MLP, bf16 attn", ("--method", "gptq", *INT4_G128, "--attention-bits", "16"),
       default=False),
    _q("int8-fp32", "int8 sym RTN, per channel", ("--method", "rtn", "--bits", "8"), GPTQ_FP32, default=False),
    _q("int4-gptq-g128-fp32", "int4 GPTQ g128", ("--method", "gptq", *INT4_G128), GPTQ_FP32, default=False),
    Row("int8+kv-int8", "int8 sym RTN, per channel", "int8", (*GPTQ_SERVED, "--kv-dtype", "int8"),
        quantize("--method", "rtn", "--bits", "8"), default=False),
    *(_q(f"int4-{m}-g{g}", f"int4 {m.upper()} g{g}", ("--method", m, "--bits", "4", "--group-size", str(g)),
         default=False) for g in (32, 64) for m in ("rtn", "gptq")),
)


def registry() -> dict[str, Row]:
    return {r.name: r for r in ROWS}


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


def curve_row(samples: int) -> Row:
    """GPTQ INT4 g128 on the first `samples` calibration rows: the table's row, other calibration."""
    row = registry()["int4-gptq-g128"]
    base = row.make
    return replace(row, name=f"{row.name}-calib{samples}",
                   make=lambda ctx, key: base(ctx, row.name, samples))  # type: ignore[misc, call-arg]
