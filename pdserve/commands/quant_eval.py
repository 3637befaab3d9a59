"""`pdserve quant-eval`: accuracy, memory and speed of each weight format against FP32.

For every format (INT8 per channel, symmetric and asymmetric; INT4 RTN and GPTQ at group sizes 32,
64, 128; FP32 weights with an INT8 or FP8 KV cache; INT8 weights with an INT8 KV cache) the model is
quantized in memory and run through our runtime's real forward (QuantLinear on the paged cache, in
the row's KV format: every position attends to the stored, possibly quantized, keys and values):

- KL(FP32 || quantized) of next-token distributions and top-1 agreement, teacher-forced at every
  position of a fixed prompt set extended by FP32's own greedy continuation;
- perplexity on text sampled from the FP32 model (the committed `stories260k_eval.jsonl`);
- weight bytes of the decoder projections as stored (checkpoint tensors) and as resident in the
  model, and KV bytes per token from the cache tensor;
- output tokens/s on this CPU for bench-engine's workload, smaller: best of three rounds that
  interleave the formats (a shared CPU's background load then hits all of them alike).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass

from pdserve.commands.output import write_json

NAME = "quant-eval"
HELP = "accuracy (KL, top-1, perplexity), weight/KV bytes and tokens/s of INT8/INT4 formats vs FP32"

PROMPTS = (
    "Once upon a time", "Tom had a red ball.", "Lily and her brother Tom went to the park. They saw a big",
    "The little dog was sad because", "One day, a big dog named Max went to the park with his friend",
    "Sam was sad because his toy was broken. His mom said", "The bird flew high",
    "There was a little boat on the lake. It was blue and", "Mom and Dad took Sue to the zoo.",
    "The cat wanted to play with the yarn, but", "Ben found a shiny rock in the garden.", "It was a rainy day.",
)
CONTINUATION = 64  # FP32 greedy tokens appended to each prompt


@dataclass(frozen=True)
class Format:
    name: str
    bits: int  # 32 = the FP32 reference
    group_size: int
    method: str
    desc_act: bool = False
    sym: bool = True  # INT8 only: symmetric per channel (the format) or with zero points
    kv_dtype: str = "float32"

    def weight_key(self) -> tuple:
        return (self.bits, self.group_size, self.method, self.desc_act, self.sym)


def default_formats(groups: tuple[int, ...] = (32, 64, 128), act_order: bool = True) -> list[Format]:
    fmts = [Format("fp32", 32, 0, "none"), Format("kv-int8", 32, 0, "none", kv_dtype="int8"),
            Format("kv-fp8", 32, 0, "none", kv_dtype="fp8_e4m3"),
            Format("int8", 8, -1, "rtn"), Format("int8-gptq", 8, -1, "gptq"),
            Format("int8-asym", 8, -1, "rtn", sym=False), Format("int8-asym-gptq", 8, -1, "gptq", sym=False),
            Format("int8+kv-int8", 8, -1, "rtn", kv_dtype="int8"),
            Format("int8-asym-gptq+kv-int8", 8, -1, "gptq", sym=False, kv_dtype="int8")]
    fmts += [Format(f"int4-rtn-g{g}", 4, g, "rtn") for g in groups]
    fmts += [Format(f"int4-gptq-g{g}", 4, g, "gptq") for g in groups]
    if act_order:
        fmts += [Format(f"int4-gptq-act-g{groups[-1]}", 4, groups[-1], "gptq", True)]
    return fmts


@dataclass
class Result:
    name: str
    kl_mean: float
    top1_agreement: float
    top1_eval_text: float  # top-1 agreement at every position of the perplexity text (more positions)
    perplexity: float
    ppl_delta_pct: float
    linear_bytes: int  # decoder projections as stored in the checkpoint
    resident_linear_bytes: int  # the same, as held by the running model
    bits_per_weight: float  # linear_bytes * 8 / projection weights
    kv_bytes_per_token: float  # measured from the cache tensor, scale rows included
    tokens_per_s: float
    quantize_s: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_model_args

    add_model_args(p)
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128], help="INT4 group sizes")
    p.add_argument("--no-act-order", action="store_true", help="skip the GPTQ act-order row")
    p.add_argument("--only", nargs="+", default=None, metavar="FORMAT",
                   help="run only these rows (names as in the table; fp32 always runs: it is the baseline)")
    p.add_argument("--calib", default="stories260k", help="GPTQ calibration set or file")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=128)
    p.add_argument("--eval", default="stories260k-eval", help="perplexity text: builtin set or file")
    p.add_argument("--num-requests", type=int, default=32, help="requests of the tokens/s workload")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="write the results as JSON to this path ('-': stdout)")


# ---- measurements ---------------------------------------------------------------------------------

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
    """Mean KL(ref || got) over all positions, and the fraction whose argmax agrees."""
    import torch

    kl, agree, n = 0.0, 0, 0
    for r, g in zip(ref, got):
        lr, lg = torch.log_softmax(r.double(), -1), torch.log_softmax(g.double(), -1)
        kl += (lr.exp() * (lr - lg)).sum().item()
        agree += (r.argmax(-1) == g.argmax(-1)).sum().item()
        n += r.shape[0]
    return kl / n, agree / n


def perplexity(logits: list, seqs: list[list[int]]) -> float:
    import math

    import torch

    nll, n = 0.0, 0
    for lg, ids in zip(logits, seqs):
        target = torch.tensor(ids[1:])
        nll += torch.nn.functional.cross_entropy(lg[:-1].double(), target, reduction="sum").item()
        n += len(ids) - 1
    return math.exp(nll / n)


def linear_bytes(weights: dict) -> tuple[int, int]:
    """(bytes of the decoder projections as checkpoint tensors, number of weights they stand for)."""
    from pdserve.quant.checkpoint import state_dict

    total, params = 0, 0
    for name, w in weights.items():
        if not name.endswith("_proj.weight"):
            continue
        params += w.shape[0] * w.shape[1]
        total += sum(t.numel() * t.element_size() for t in state_dict({name: w}, False).values())
    return total, params


def resident_bytes(model) -> int:
    return sum(lin.nbytes for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


def tokens_per_s(engines: list, num_requests: int, rounds: int = 3) -> list[float]:
    """Output tokens/s of each engine on bench-engine's workload: best of `rounds` rounds that run
    every engine in turn, so that all formats see the same background load of a shared CPU."""
    from pdserve.commands.bench_engine import make_workload, run_pdserve

    ns = argparse.Namespace(seed=0, num_requests=num_requests, prompt_len=(4, 40), output_len=(16, 64))
    work = make_workload(ns, engines[0].model_config.vocab_size)
    warm = make_workload(argparse.Namespace(**{**vars(ns), "num_requests": 4}), 64)
    for engine in engines:
        run_pdserve(engine, warm)
    best = [0.0] * len(engines)
    for _ in range(rounds):
        for i, engine in enumerate(engines):
            best[i] = max(best[i], run_pdserve(engine, work).tokens_per_s)
    return best


# ---- the run --------------------------------------------------------------------------------------

def quantized_weights(checkpoint, fmt: Format, calib):
    from pdserve.quant.layerwise import quantize_model
    from pdserve.quant.spec import QuantSpec

    if fmt.bits == 32:
        return checkpoint.weights
    spec = QuantSpec(fmt.bits, fmt.group_size, sym=fmt.bits == 8 and fmt.sym, desc_act=fmt.desc_act)
    return quantize_model(checkpoint.config, checkpoint.weights, spec, fmt.method,
                          calib if fmt.method == "gptq" else None)


def evaluate(checkpoint, formats: list[Format], args: argparse.Namespace, log=print) -> list[Result]:
    from pdserve.quant.calibration import load_texts, token_chunks
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.kv_cache import kv_bytes_per_token
    from pdserve.runtime.sampling_params import SamplingParams

    tok = checkpoint.tokenizer
    calib = token_chunks(tok, load_texts(args.calib), args.calib_seq_len, args.calib_samples)
    eval_seqs = [tok.encode(t) for t in load_texts(args.eval)]
    cache = EngineConfig(cache=CacheConfig(num_blocks=1024))
    ref_engine = Engine.from_checkpoint(checkpoint, cache)
    prompts = [tok.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=CONTINUATION, temperature=0, ignore_eos=True)
    kl_seqs = [p + s.output_ids for p, s in zip(prompts, ref_engine.generate(prompts, greedy))]
    ref_kl_logits = [sequence_logits(ref_engine.runner.model, s) for s in kl_seqs]
    ref_eval_logits = [sequence_logits(ref_engine.runner.model, s) for s in eval_seqs]
    results, engines, ref_ppl, made = [], [], None, {}
    for fmt in formats:
        start = time.perf_counter()
        if fmt.weight_key() not in made:  # KV-only rows reuse the weights of an earlier row
            made[fmt.weight_key()] = quantized_weights(checkpoint, fmt, calib)
        weights = made[fmt.weight_key()]
        quantize_s = time.perf_counter() - start
        engine = Engine(checkpoint.config, weights, checkpoint.fingerprint,
                        EngineConfig(cache=CacheConfig(num_blocks=1024, dtype=fmt.kv_dtype)))
        model = engine.runner.model
        kl, top1 = kl_and_top1(ref_kl_logits, [sequence_logits(model, s, kv_dtype=fmt.kv_dtype) for s in kl_seqs])
        eval_logits = [sequence_logits(model, s, kv_dtype=fmt.kv_dtype) for s in eval_seqs]
        ppl = perplexity(eval_logits, eval_seqs)
        _, top1_text = kl_and_top1(ref_eval_logits, eval_logits)
        ref_ppl = ref_ppl or ppl
        lb, params = linear_bytes(weights)
        results.append(Result(
            fmt.name, kl, top1, top1_text, ppl, 100 * (ppl / ref_ppl - 1), lb, resident_bytes(model), 8 * lb / params,
            kv_bytes_per_token(engine.kv_cache), 0.0, quantize_s))
        engines.append(engine)
        log(f"{fmt.name}: done", file=sys.stderr)
    for r, tps in zip(results, tokens_per_s(engines, args.num_requests)):
        r.tokens_per_s = tps
    return results


def print_table(results: list[Result]) -> None:
    head = (f"{'format':<24}{'KL':>9}{'top-1':>8}{'top-1 txt':>10}{'ppl':>8}{'Δppl%':>8}{'lin KB':>8}{'res KB':>8}"
            f"{'bits/w':>7}{'KV B/tok':>9}{'tok/s':>8}{'quant s':>8}")
    print(head)
    for r in results:
        print(f"{r.name:<24}{r.kl_mean:>9.5f}{100 * r.top1_agreement:>7.2f}%{100 * r.top1_eval_text:>9.2f}%"
              f"{r.perplexity:>8.3f}"
              f"{r.ppl_delta_pct:>+8.2f}{r.linear_bytes / 1024:>8.1f}{r.resident_linear_bytes / 1024:>8.1f}"
              f"{r.bits_per_weight:>7.2f}{r.kv_bytes_per_token:>9.0f}{r.tokens_per_s:>8.0f}{r.quantize_s:>8.1f}")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdserve.quant.spec import QuantError
    from pdserve.runtime.loader import ModelLoadError, load_checkpoint, resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        checkpoint = load_checkpoint(resolve_model_path(args.model))
        formats = default_formats(tuple(args.groups), not args.no_act_order)
        if args.only:
            unknown = sorted(set(args.only) - {f.name for f in formats})
            if unknown:
                raise QuantError(f"unknown format(s) {', '.join(unknown)} (known: {', '.join(f.name for f in formats)})")
            formats = [f for f in formats if f.name == "fp32" or f.name in args.only]
        results = evaluate(checkpoint, formats, args,
                           log=lambda *a, **k: print(*a, **k))
    except (QuantError, ModelLoadError) as e:
        print(f"pdserve quant-eval: error: {e}", file=sys.stderr)
        return 2
    print_table(results)
    if args.json:
        write_json(args.json, {"model": str(checkpoint.source), "prompts": len(PROMPTS),
                               "continuation": CONTINUATION, "formats": [asdict(r) for r in results]})
    return 0
