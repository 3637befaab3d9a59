"""Measurements behind docs/quantization-activations.md: W8A8 matmul kernels, and the formats'
agreement with FP32 on a real model.

    python -m pdserve.quant.int8_bench kernels [--threads 1] [--rounds 7]
    python -m pdserve.quant.int8_bench accuracy [--model PATH] [--formats ...]

kernels: microseconds per call, activation quantization included, from an fp32 x [rows, K] to an
fp32 y [rows, M], for each candidate at 1, 8, 32 and 512 rows on SmolLM2's projection shapes; the
median of each round's calls, the best round (rounds interleave the candidates, so that all of them
see the same background load).

accuracy: KL(fp32 || format) and top-1 agreement over teacher-forced positions (chat prompts
extended by FP32's greedy answer), each format built in-process by its `layerwise` function.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

from pdserve.quant.int8_act import DYNAMIC, W8A8Linear, quantize_dynamic

# SmolLM2-135M's projections as (K, M): q/o [576 -> 576] aside, gate/up, down and k/v.
SMOLLM2_SHAPES = ((576, 1536), (1536, 576), (576, 192))
ROWS = (1, 8, 32, 512)


def _candidates(k: int, m: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each kernel computing y = x @ W^T from the same INT8 weight (per-channel symmetric)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(m, k, generator=g) * 0.05
    sw = w.abs().amax(1) / 127
    wq = torch.round(w / sw[:, None]).clamp(-127, 127).to(torch.int8)  # [M, K]
    wq_kn = wq.t().contiguous()  # [K, M]
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated, and still what fbgemm takes
        warnings.simplefilter("ignore")
        packed_onednn = torch.ops.onednn.qlinear_prepack(wq, [1, k])
        packed_fbgemm = torch.ops.quantized.linear_prepack(
            torch._make_per_channel_quantized_tensor(wq, sw.double(), torch.zeros(m, dtype=torch.long), 0), None)
    zeros = torch.zeros(m, dtype=torch.long)
    w_fp32, w_bf16 = wq.float() * sw[:, None], (wq.float() * sw[:, None]).bfloat16()

    int_mm = W8A8Linear(wq, sw, DYNAMIC)  # the kept kernel, as the model runs it: W read as a transposed view

    def int_mm_kn(x):  # the same with a contiguous [K, M] copy of W
        qx, sx = quantize_dynamic(x)
        return torch._int_mm(qx, wq_kn).float().mul_(sx).mul_(sw)

    def onednn(x):  # per-token scales applied after: onednn takes one activation scale
        qx, sx = quantize_dynamic(x)
        xu = (qx.to(torch.int16) + 128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, packed_onednn, sw, zeros, None, 1.0, 0,
                                               torch.float32, "none", [], "")
        return y * sx

    def fbgemm(x):  # per-tensor dynamic activations, 7-bit range: another format, timed for reference
        return torch.ops.quantized.linear_dynamic(x, packed_fbgemm, True)

    def dequant_fp32(x):  # fake-quantized activations, weight dequantized on the call
        qx, sx = quantize_dynamic(x)
        return (qx.float() * sx) @ (wq.float() * sw[:, None]).t()

    def dequant_bf16(x):
        qx, sx = quantize_dynamic(x)
        return ((qx.float() * sx).bfloat16() @ (wq.bfloat16() * sw.bfloat16()[:, None]).t()).float()

    return {"int_mm": int_mm, "int_mm_kn": int_mm_kn, "onednn": onednn, "fbgemm_dyn": fbgemm,
            "dequant_fp32": dequant_fp32, "dequant_bf16": dequant_bf16,
            "dense_fp32": lambda x: x @ w_fp32.t(), "dense_bf16": lambda x: (x.bfloat16() @ w_bf16.t()).float()}


def _time(fn: Callable[[], object], calls: int) -> float:
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def kernel_timings(shapes=SMOLLM2_SHAPES, rows=ROWS, rounds: int = 7) -> list[dict]:
    """[{"K", "M", "rows", "<candidate>": us, ...}] (best round's median per call)."""
    out = []
    for k, m in shapes:
        cands = _candidates(k, m)
        for n in rows:
            x = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
            calls = 40 if n < 512 else 6
            best = {name: float("inf") for name in cands}
            for fn in cands.values():
                fn(x)  # warm up (packing caches, allocator)
            for _ in range(rounds):
                for name, fn in cands.items():
                    best[name] = min(best[name], _time(lambda: fn(x), calls))
            out.append({"K": k, "M": m, "rows": n} | best)
    return out


# ---- accuracy on a real model ---------------------------------------------------------------------

CHAT_QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.",
                  "Explain in one sentence what a CPU does.", "List three colors.",
                  "How do I reverse a list in Python?")
FORMATS = ("int8-w8a16", "dynamic-int8", "w8a8-minmax", "w8a8-percentile", "int4-rtn-g128",
           "mixed-rtn-attn8", "mixed-rtn-attn16", "mixed-gptq-attn8", "mixed-gptq-attn16")


def build_format(name: str, checkpoint, calib: torch.Tensor) -> dict:
    """The weight dict of format `name` (see FORMATS), made in-process from `checkpoint`."""
    from pdserve.quant.layerwise import quantize_model, quantize_w8a8
    from pdserve.quant.spec import ActSpec, QuantSpec, attention_rules

    c, w = checkpoint.config, checkpoint.weights
    if name == "int8-w8a16":
        return quantize_model(c, w, QuantSpec(8, -1, sym=True), "rtn")
    if name == "dynamic-int8":
        return quantize_w8a8(c, w, ActSpec("dynamic"))
    if name.startswith("w8a8-"):
        return quantize_w8a8(c, w, ActSpec("static", name.removeprefix("w8a8-")), calib)
    int4 = QuantSpec(4, 128, sym=False)
    if name == "int4-rtn-g128":
        return quantize_model(c, w, int4, "rtn")
    _, method, attn = name.split("-")
    return quantize_model(c, w, int4, method, calib if method == "gptq" else None,
                          rules=attention_rules(int(attn.removeprefix("attn"))))


def teacher_forced_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """All-position logits [T, V] of one sequence through the runtime forward, on a private cache."""
    from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
    from pdserve.runtime.config import CacheConfig
    from pdserve.runtime.kv_cache import allocate_kv_cache

    t, blocks = len(ids), -(-len(ids) // block_size)
    kv = allocate_kv_cache(model.config, CacheConfig(block_size=block_size, num_blocks=blocks), "cpu")
    meta = AttentionMetadata(slot_mapping=torch.arange(t), num_decode_tokens=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.long),
                             decode_context_lens=torch.zeros(0, dtype=torch.long),
                             prefills=(PrefillSpan(0, t, t, torch.arange(blocks)),))
    return model.compute_logits(model.forward(torch.tensor(ids), torch.arange(t), meta, kv))


def kl_top1(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float, int]:
    """Mean KL(ref || got) per position, top-1 agreement, positions."""
    kl, agree, n = 0.0, 0, 0
    for r, g in zip(ref, got):
        lr, lg = torch.log_softmax(r.double(), -1), torch.log_softmax(g.double(), -1)
        kl += (lr.exp() * (lr - lg)).sum().item()
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += r.shape[0]
    return kl / n, agree / n, n


def accuracy(model_path: str | None, formats: tuple[str, ...], answer_tokens: int, calib_rows: int,
             log=print) -> list[tuple[str, float, float, int, float]]:
    """[(format, KL, top-1, positions, seconds to build)] against the FP32 model of the same file."""
    from pdserve.quant.calibration import load_texts, token_chunks
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path
    from pdserve.runtime.sampling_params import SamplingParams

    ck = load_checkpoint(resolve_model_path(model_path))
    tok, cache = ck.tokenizer, EngineConfig(cache=CacheConfig(num_blocks=128))
    ref = Engine.from_checkpoint(ck, cache)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT_QUESTIONS]
    outs = ref.generate(prompts, SamplingParams(max_tokens=answer_tokens, temperature=0, ignore_eos=True))
    seqs = [p + o.output_ids for p, o in zip(prompts, outs)]
    with torch.inference_mode():
        ref_logits = [teacher_forced_logits(ref.runner.model, s) for s in seqs]
    calib = token_chunks(tok, load_texts("stories260k"), 128, calib_rows)
    rows = []
    for name in formats:
        t0 = time.perf_counter()
        weights = build_format(name, ck, calib)
        built = time.perf_counter() - t0
        model = Engine(ck.config, weights, ck.fingerprint, cache).runner.model
        with torch.inference_mode():
            kl, top1, n = kl_top1(ref_logits, [teacher_forced_logits(model, s) for s in seqs])
        rows.append((name, kl, top1, n, built))
        log(f"{name:18s} KL {kl:.5f}  top-1 {100 * top1:6.2f} %  ({n} positions, built in {built:.0f} s)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.quant.int8_bench")
    sub = p.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--threads", type=int, default=1)
    k.add_argument("--rounds", type=int, default=7)
    a = sub.add_parser("accuracy")
    a.add_argument("--model", default=None, help="default: the installed SmolLM2-135M-Instruct")
    a.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    a.add_argument("--answer-tokens", type=int, default=64)
    a.add_argument("--calib-rows", type=int, default=32, help="calibration rows of 128 tokens (static W8A8, GPTQ)")
    a.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "kernels":
        for row in kernel_timings(rounds=args.rounds):
            cells = " ".join(f"{name}={us:.0f}" for name, us in row.items() if name not in ("K", "M", "rows"))
            print(f"[{row['rows']}, {row['K']}] x [{row['K']}, {row['M']}]: {cells}", flush=True)
    else:
        accuracy(args.model, tuple(args.formats), args.answer_tokens, args.calib_rows,
                 log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
