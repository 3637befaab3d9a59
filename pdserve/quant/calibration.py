"""Calibration text for GPTQ: a builtin set sampled from the FP32 model it is meant for, or a user file.

Builtin sets live in `data/` as JSON lines ({"text": ...}), each what the model itself writes:
`stories260k` by `sample_texts` (seeded sampling at temperature 1 from BOS), `smollm2` by
`chat_texts` (SmolLM2-135M-Instruct's answers, sampled at temperature 1, to the calibration
prompts `smollm2_calib_prompts.jsonl`, each document the whole chat: template, question, answer;
`python -m pdserve.quant.calibration smollm2` remakes it). The held-out prompts of `pdserve
quant-eval` (`smollm2_heldout_prompts.jsonl`) are disjoint from the calibration prompts. A user file
is JSON lines with a "text" field, or plain text whose blank-line-separated paragraphs are documents.
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
    "smollm2": DATA_DIR / "smollm2_calib.jsonl",  # 64 calibration prompts x 2 answers, seeds 3000..3127
}
CALIB_PROMPTS = DATA_DIR / "smollm2_calib_prompts.jsonl"
SMOLLM2_SEED, SMOLLM2_ANSWERS_PER_PROMPT, SMOLLM2_MAX_TOKENS = 3000, 2, 192


AUTO = "auto"


def has_chat_template(tokenizer) -> bool:
    inner = getattr(tokenizer, "_tok", None)  # HFTokenizer wraps transformers' tokenizer
    return bool(getattr(tokenizer, "chat_template", None) or getattr(inner, "chat_template", None))


def resolve_set(source: str, tokenizer) -> str:
    """`source`, with "auto" made the builtin set that matches the model: the chat documents of
    `smollm2` for a chat model (its tokenizer has a chat template), else the `stories260k` stories.
    Calibration text should look like what the model will be asked to do."""
    if source != AUTO:
        return source
    return "smollm2" if has_chat_template(tokenizer) else "stories260k"


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


def load_prompts(path: Path) -> list[str]:
    """The "prompt" field of each JSON line of `path`."""
    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user turn through the model's chat template, ready for the answer."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def chat_answers(engine, tokenizer, prompts: list[str], seed: int, max_tokens: int, temperature: float = 1.0,
                 per_prompt: int = 1) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the model's sampled answers, request j seeded seed + j (prompt
    j // per_prompt): what the model itself says, the distribution the format must keep."""
    from pdserve.runtime.sampling_params import SamplingParams

    asks = [chat_prompt_ids(tokenizer, p) for p in prompts for _ in range(per_prompt)]
    seqs = [engine.add_request(f"chat-{seed + j}", ids,
                               SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + j))
            for j, ids in enumerate(asks)]
    while engine.has_unfinished():
        engine.step()
    return [(ids, list(s.output_ids)) for ids, s in zip(asks, seqs)]


def chat_texts(engine, tokenizer, prompts: list[str], seed: int, max_tokens: int, per_prompt: int = 1) -> list[str]:
    """Whole chats (template, question, sampled answer) as text: calibration documents."""
    return [tokenizer.decode(ids + out, skip_special=False)
            for ids, out in chat_answers(engine, tokenizer, prompts, seed, max_tokens, per_prompt=per_prompt)]


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")


def make_smollm2_set(model: str | None = None) -> Path:
    """Writes the `smollm2` builtin set from the FP32 model (default: the installed SmolLM2)."""
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path

    checkpoint = load_checkpoint(resolve_model_path(model))
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=2048)))
    texts = chat_texts(engine, checkpoint.tokenizer, load_prompts(CALIB_PROMPTS), SMOLLM2_SEED, SMOLLM2_MAX_TOKENS,
                       SMOLLM2_ANSWERS_PER_PROMPT)
    write_jsonl(BUILTIN["smollm2"], texts)
    return BUILTIN["smollm2"]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["smollm2"]:
        sys.exit("usage: python -m pdserve.quant.calibration smollm2 [MODEL]")
    print(make_smollm2_set(sys.argv[2] if len(sys.argv) > 2 else None))
