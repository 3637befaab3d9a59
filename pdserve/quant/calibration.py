"""Calibration text for GPTQ: a builtin set sampled from the FP32 stories260K model, or a user file.

Builtin sets live in `data/` as JSON lines ({"text": ...}); `sample_texts` is how they were made
(seeded sampling at temperature 1 from BOS, so they are what the model itself writes). A user file is
JSON lines with a "text" field, or plain text whose blank-line-separated paragraphs are documents.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pdserve.quant.spec import QuantError

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = {
    "stories260k": DATA_DIR / "stories260k_calib.jsonl",  # 128 samples, seeds 1000..1127
    "stories260k-eval": DATA_DIR / "stories260k_eval.jsonl",  # 32 samples, seeds 2000..2031 (quant-eval)
}


def load_texts(source: str) -> list[str]:
    """The documents of a builtin set name or a file path."""
    path = BUILTIN.get(source) or Path(source).expanduser()
    if not path.exists():
        raise QuantError(f"calibration set {source!r}: no such builtin ({', '.join(BUILTIN)}) or file")
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        try:
            texts = [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        except (ValueError, KeyError, TypeError) as e:
            raise QuantError(f"{path}: every line must be a JSON object with a 'text' field ({e})") from e
    else:
        texts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    if not texts:
        raise QuantError(f"{path}: no calibration text")
    return texts


def token_chunks(tokenizer, texts: list[str], seq_len: int, num_samples: int) -> torch.Tensor:
    """The documents tokenized (BOS first), concatenated and cut into [n, seq_len] rows, n <= num_samples.

    Rows of equal length let the layer-wise pass run them as one batch; a document boundary inside a
    row is fine for estimating the inputs' second moments, which is all GPTQ uses.
    """
    stream: list[int] = []
    for t in texts:
        stream += tokenizer.encode(t, add_bos=True)
        if len(stream) >= seq_len * num_samples:
            break
    n = min(len(stream) // seq_len, num_samples)
    if n == 0:
        raise QuantError(f"calibration text has {len(stream)} tokens, fewer than one row of {seq_len}")
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).view(n, seq_len)


def sample_texts(engine, tokenizer, num: int, seed: int, max_tokens: int = 256) -> list[str]:
    """Texts the model writes from BOS at temperature 1, request i seeded with seed + i."""
    from pdserve.runtime.sampling_params import SamplingParams

    prompt = [tokenizer.bos_id]
    seqs = [engine.add_request(f"calib-{seed + i}", prompt,
                               SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + i))
            for i in range(num)]
    while engine.has_unfinished():
        engine.step()
    return [tokenizer.decode(s.output_ids).strip() for s in seqs]


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
