"""`pdserve quantize`: quantization of a checkpoint into a GPTQ-format directory.

Weight-only: INT8 (per output channel, symmetric, or asymmetric with --asym) or INT4 (group-wise,
with zero points), by round-to-nearest or GPTQ on a calibration set; `--attention-bits 8|16` keeps
the attention projections at INT8 or unquantized (GPTQModel's `dynamic` rules). W8A8: INT8 weights
with INT8 activations, per token at run time (`--method dynamic-int8`) or with calibrated static
scales (`--method w8a8 --observer minmax|percentile`). The output loads with `pdserve up --model OUT`
and, weights-wise, with GPTQ tooling (docs/quantization.md, docs/quantization-activations.md).
"""

from __future__ import annotations

import argparse
import sys

NAME = "quantize"
HELP = ("quantize a model (INT8 per channel, INT4 group-wise, mixed; RTN or GPTQ; W8A8 dynamic or static) "
        "into a GPTQ checkpoint")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_model_args

    add_model_args(p)
    p.add_argument("--method", default="gptq",
                   help="rtn or gptq (weight-only); dynamic-int8 (W8A8, activations per token at run time) "
                        "or w8a8 (W8A8, static activation scales from calibration)")
    p.add_argument("--bits", type=int, default=None,
                   help="8 (per output channel, symmetric) or 4 (group-wise); default 4 (8 for W8A8, the only choice)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input channels per scale: 32, 64, 128, or -1 for one per output channel "
                        "(default: 128 for 4 bits, -1 for 8 bits)")
    p.add_argument("--asym", action="store_true",
                   help="INT8 with a zero point per output channel instead of symmetric (INT4 is always asymmetric)")
    p.add_argument("--attention-bits", type=int, default=None, choices=(8, 16),
                   help="mixed formats: attention projections at INT8 per channel (8) or unquantized (16), "
                        "the MLP at --bits (default: attention like the MLP)")
    p.add_argument("--observer", default=None,
                   help="w8a8: how activation ranges are calibrated: minmax (default) or percentile")
    p.add_argument("--percentile", type=float, default=99.99,
                   help="w8a8 --observer percentile: the percentile kept (its mirror is the low end)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ in activation order (act-order)")
    p.add_argument("--calib", default="auto",
                   help="calibration text: auto (smollm2's chat documents for a model with a chat template, "
                        "else stories260k), a builtin set name (smollm2, stories260k) or a .jsonl/.txt file")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration rows")
    p.add_argument("--calib-seq-len", type=int, default=128, help="tokens per calibration row")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ damping, as a fraction of the mean Hessian diagonal")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.quant.spec import QuantError
    from pdserve.runtime.loader import ModelLoadError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        out = _quantize(args)
    except (QuantError, ModelLoadError) as e:
        print(f"pdserve quantize: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _quantize(args: argparse.Namespace):
    from pdserve.quant.calibration import load_texts, resolve_set, token_chunks
    from pdserve.quant.checkpoint import quantization_config, save_quantized
    from pdserve.quant.layerwise import STAGES, W8A8_WEIGHTS, quantize_model, quantize_w8a8
    from pdserve.quant.progress import ProgressBar
    from pdserve.quant.spec import attention_rules
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path

    act = _act_spec(args)
    spec = W8A8_WEIGHTS if act is not None else _weight_spec(args)
    rules = attention_rules(args.attention_bits) if args.attention_bits is not None else None
    checkpoint = load_checkpoint(resolve_model_path(args.model))
    provenance = {"source": checkpoint.source.name, "source_fingerprint": checkpoint.fingerprint,
                  "created_by": "pdserve quantize"}
    calib = None
    if args.method == "gptq" or (act is not None and act.scheme == "static"):
        calib_set = resolve_set(args.calib, checkpoint.tokenizer)
        calib = token_chunks(checkpoint.tokenizer, load_texts(calib_set), args.calib_seq_len, args.calib_samples)
        provenance["calibration"] = {"set": calib_set, "rows": int(calib.shape[0]), "seq_len": args.calib_seq_len}
    bar = ProgressBar(checkpoint.config.num_layers * len(STAGES), f"{args.method} int{spec.bits}")
    if act is not None:
        weights = quantize_w8a8(checkpoint.config, checkpoint.weights, act, calib, bar)
        provenance["weights"] = "rtn"
    else:
        weights = quantize_model(checkpoint.config, checkpoint.weights, spec, args.method, calib, args.damp, bar,
                                 rules=rules)
    qconfig = quantization_config(spec, args.method, args.damp, provenance, dynamic=rules, activations=act)
    return save_quantized(args.out, checkpoint, weights, qconfig)


def _weight_spec(args: argparse.Namespace):
    from pdserve.quant.spec import QuantError, QuantSpec, check_quantize_request

    if args.observer is not None:
        raise QuantError("--observer needs --method w8a8 (static activation scales)")
    bits = args.bits if args.bits is not None else 4
    group = args.group_size if args.group_size is not None else (-1 if bits == 8 else 128)
    spec = check_quantize_request(bits, group, args.method, args.asym)
    if args.desc_act:
        if args.method != "gptq":
            raise QuantError("--desc-act needs --method gptq")
        spec = QuantSpec(spec.bits, spec.group_size, spec.sym, desc_act=True)
    return spec


def _act_spec(args: argparse.Namespace):
    """The activation spec of --method dynamic-int8 / w8a8 (None for weight-only methods)."""
    from pdserve.quant.spec import ACT_METHODS, ActSpec, QuantError

    scheme = ACT_METHODS.get(args.method)
    if scheme is None:
        return None
    given = (("--bits", args.bits not in (None, 8)), ("--asym", args.asym),
             ("--group-size", args.group_size not in (None, -1)), ("--desc-act", args.desc_act),
             ("--attention-bits", args.attention_bits is not None))
    bad = [flag for flag, is_set in given if is_set]
    if bad:
        raise QuantError(f"--method {args.method} makes INT8 per-channel symmetric weights for every projection: "
                         f"drop {', '.join(bad)}")
    if scheme == "dynamic":
        if args.observer is not None:
            raise QuantError("--observer needs --method w8a8 (dynamic-int8 computes scales per token)")
        return ActSpec("dynamic")
    return ActSpec("static", args.observer or "minmax", args.percentile)
