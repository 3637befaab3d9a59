"""`pdserve qat`: quantization-aware training by distillation from the FP32 model, exported as the
GPTQ-format checkpoint `pdserve quantize` writes (quantization_config "method": "qat").

The FP32 model writes the training text from a prompt set; the decoder projections are then
fine-tuned with fake quantization in the forward (the export's RTN rule) and the straight-through
estimator in the backward, on KL(FP32 || student). See docs/qat.md and `pdserve.quant.qat`.
"""

from __future__ import annotations

import argparse
import sys

NAME = "qat"
HELP = "quantization-aware training (distillation from FP32, fake-quant + STE) into a GPTQ checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_model_args

    add_model_args(p)
    p.add_argument("--bits", type=int, default=4, help="4 (group-wise, asymmetric) or 8 (per output channel)")
    p.add_argument("--group-size", type=int, default=None,
                   help="input channels per scale: 32, 64, 128, or -1 for one per output channel "
                        "(default: 128 for 4 bits, -1 for 8 bits)")
    p.add_argument("--asym", action="store_true", help="INT8 with a zero point per output channel (as quantize)")
    p.add_argument("--steps", type=int, default=100, help="optimiser steps")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate, cosine-decayed to a tenth (default: 3e-4 up to 1M projection "
                        "weights, else 2e-5)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training row")
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--calibration", default="auto",
                   help="prompts the FP32 model continues to make the training text: stories, chat, a file "
                        "with one prompt per line, or auto (chat when the tokenizer has a chat template)")
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens the FP32 model writes per prompt")
    p.add_argument("--ce-weight", type=float, default=0.0,
                   help="weight of the cross-entropy on the text added to the KL (0: distillation only)")
    p.add_argument("--seed", type=int, default=0, help="order of the training rows")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--compare", action="store_true",
                   help="also measure held-out KL and top-1 vs FP32 of RTN, GPTQ (calibrated on the same text) "
                        "and QAT in the same format, and print them")
    p.add_argument("--compare-gptq-rows", type=int, default=32, help="with --compare: GPTQ's calibration rows")
    p.add_argument("--json", default=None, help="with --compare: write the measurements as JSON to this path")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from pdserve.quant.progress import ProgressBar
    from pdserve.quant.qat import QATConfig, generate_rows, qat_quantize, save_qat_checkpoint
    from pdserve.quant.spec import QuantError, QuantSpec, check_quantize_request
    from pdserve.runtime.loader import ModelLoadError, load_checkpoint, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    group = args.group_size if args.group_size is not None else (-1 if args.bits == 8 else 128)
    try:
        if args.json and not args.compare:
            raise QuantError("--json writes the --compare measurements: add --compare")
        spec: QuantSpec = check_quantize_request(args.bits, group, "rtn", args.asym)
        # Validated before the model loads: a bad flag costs nothing.
        cfg = QATConfig(spec, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                        batch=args.batch, seed=args.seed, ce_weight=args.ce_weight, gen_tokens=args.gen_tokens,
                        prompts=args.calibration)
        checkpoint = load_checkpoint(resolve_model_path(args.model))
        start = time.perf_counter()
        data = generate_rows(checkpoint, cfg)
        print(f"training text: {data[1]['rows']} rows of {cfg.seq_len} tokens ({time.perf_counter() - start:.0f} s)",
              file=sys.stderr)
        baseline = Comparison(checkpoint, spec, data[0][:args.compare_gptq_rows]) if args.compare else None
        bar = ProgressBar(cfg.steps, f"qat int{spec.bits} g{spec.group_size}")
        result = qat_quantize(checkpoint, cfg, progress=lambda step, kl: bar(f"kl {kl:.4f}"), data=data)
        out = save_qat_checkpoint(args.out, checkpoint, result)
        if baseline is not None:
            baseline.report(result, args.json)
    except (QuantError, ModelLoadError) as e:
        print(f"pdserve qat: error: {e}", file=sys.stderr)
        return 2
    print(f"{out} ({result.config.steps} steps at lr {result.lr:g}, {result.wall_s:.0f} s, last-step KL {result.losses[-1]:.4f})")
    return 0



class Comparison:
    """`--compare`: RTN and GPTQ of the same format measured before training, QAT after, all on
    held-out text the FP32 model wrote (`qat.heldout_sequences`), teacher-forced."""

    def __init__(self, checkpoint, spec, rows) -> None:
        import time

        from pdserve.quant.layerwise import quantize_model
        from pdserve.quant.qat import heldout_logits, heldout_sequences, kl_top1

        self.checkpoint, self.spec, self.rows = checkpoint, spec, []
        config = checkpoint.config
        self.seqs = heldout_sequences(checkpoint)
        self.ref = heldout_logits(config, checkpoint.weights, self.seqs)
        for method, calib in (("rtn", None), ("gptq", rows)):
            start = time.perf_counter()
            weights = quantize_model(config, checkpoint.weights, spec, method, calib)
            seconds = time.perf_counter() - start
            kl, top1, n = kl_top1(self.ref, heldout_logits(config, weights, self.seqs))
            self.rows.append({"method": method, "kl": kl, "top1": top1, "positions": n, "seconds": seconds,
                              "calibration_rows": 0 if calib is None else int(calib.shape[0])})
            print(f"{method}: kl {kl:.5f} top-1 {100 * top1:.2f} % ({seconds:.0f} s)", file=sys.stderr)

    def report(self, result, json_path: str | None) -> None:
        from pdserve.commands.output import write_json
        from pdserve.quant.qat import heldout_logits, kl_top1

        kl, top1, n = kl_top1(self.ref, heldout_logits(self.checkpoint.config, result.weights, self.seqs))
        self.rows.append({"method": "qat", "kl": kl, "top1": top1, "positions": n, "seconds": result.wall_s,
                          "steps": result.config.steps, "lr": result.lr, "batch": result.config.batch,
                          "seq_len": result.config.seq_len, "train_rows": result.data["rows"]})
        print(f"{'method':<8}{'KL':>10}{'top-1':>9}{'positions':>11}{'seconds':>9}")
        for r in self.rows:
            print(f"{r['method']:<8}{r['kl']:>10.5f}{100 * r['top1']:>8.2f}%{r['positions']:>11}{r['seconds']:>9.0f}")
        if json_path:
            write_json(json_path, {"model": str(self.checkpoint.source), "bits": self.spec.bits,
                                   "group_size": self.spec.group_size, "results": self.rows})
