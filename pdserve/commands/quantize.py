"""`pdserve quantize`: weight-only quantization of a checkpoint into a GPTQ-format directory.

INT8 (per output channel, symmetric, or asymmetric with --asym) or INT4 (group-wise, with zero points), by round-to-nearest or
GPTQ on a calibration set; the output loads with `pdserve up --model OUT` and with GPTQ tooling.
"""

from __future__ import annotations

import argparse
import sys

NAME = "quantize"
HELP = "quantize a model's weights (INT8 per channel, INT4 group-wise; RTN or GPTQ) into a GPTQ checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_model_args

    add_model_args(p)
    p.add_argument("--method", default="gptq", help="rtn or gptq")
    p.add_argument("--bits", type=int, default=4, help="8 (per output channel, symmetric) or 4 (group-wise)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input channels per scale: 32, 64, 128, or -1 for one per output channel "
                        "(default: 128 for 4 bits, -1 for 8 bits)")
    p.add_argument("--asym", action="store_true",
                   help="INT8 with a zero point per output channel instead of symmetric (INT4 is always asymmetric)")
    p.add_argument("--desc-act", action="store_true", help="GPTQ in activation order (act-order)")
    p.add_argument("--calib", default="stories260k",
                   help="calibration text: builtin set name (stories260k) or a .jsonl/.txt file")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration rows")
    p.add_argument("--calib-seq-len", type=int, default=128, help="tokens per calibration row")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ damping, as a fraction of the mean Hessian diagonal")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.quant.calibration import load_texts, token_chunks
    from pdserve.quant.checkpoint import quantization_config, save_quantized
    from pdserve.quant.layerwise import STAGES, quantize_model
    from pdserve.quant.progress import ProgressBar
    from pdserve.quant.spec import QuantError, QuantSpec, check_quantize_request
    from pdserve.runtime.loader import ModelLoadError, load_checkpoint, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    group = args.group_size if args.group_size is not None else (-1 if args.bits == 8 else 128)
    try:
        spec = check_quantize_request(args.bits, group, args.method, args.asym)
        if args.desc_act:
            if args.method != "gptq":
                raise QuantError("--desc-act needs --method gptq")
            spec = QuantSpec(spec.bits, spec.group_size, spec.sym, desc_act=True)
        checkpoint = load_checkpoint(resolve_model_path(args.model))
        calib = None
        provenance = {"source": checkpoint.source.name, "source_fingerprint": checkpoint.fingerprint,
                      "created_by": "pdserve quantize"}
        if args.method == "gptq":
            calib = token_chunks(checkpoint.tokenizer, load_texts(args.calib), args.calib_seq_len, args.calib_samples)
            provenance["calibration"] = {"set": args.calib, "rows": int(calib.shape[0]), "seq_len": args.calib_seq_len}
        bar = ProgressBar(checkpoint.config.num_layers * len(STAGES), f"{args.method} int{args.bits}")
        weights = quantize_model(checkpoint.config, checkpoint.weights, spec, args.method, calib, args.damp, bar)
        qconfig = quantization_config(spec, args.method, args.damp, provenance)
        out = save_quantized(args.out, checkpoint, weights, qconfig)
    except (QuantError, ModelLoadError) as e:
        print(f"pdserve quantize: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
