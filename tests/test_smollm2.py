"""SmolLM2-135M-Instruct (Q4_1 GGUF, byte-level BPE): our runtime against transformers on the same file.

transformers dequantizes the file to fp32 with its own code; we dequantize with gguf's. The reference
model and its outputs are made once per module (`reference`); the checkpoint once per session.
Our prompts run as one batch; each sequence's logits are compared with an unbatched reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from conftest import smollm2_path
from hf_reference import load_hf_gguf_model, load_hf_gguf_tokenizer
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
    "List three colors.",
    "How do I reverse a list in Python?",
]
GREEDY_TOKENS = 64
LOGIT_STEPS = 16  # decode steps after the prefill whose logits are compared
LOGIT_PROMPTS = 3


@dataclass(frozen=True)
class Reference:
    """Our greedy outputs and what transformers says at each of their positions."""

    prompts: list[list[int]]  # chat-template token ids of QUESTIONS
    ours: list[list[int]]  # our greedy continuation of each, GREEDY_TOKENS long
    ours_logits: list[torch.Tensor]  # [1 + LOGIT_STEPS, V]: our prefill + decode logits, first prompts
    hf_next: list[list[int]]  # transformers' argmax after each prefix of prompt + ours[:-1]
    hf_logits: list[torch.Tensor]  # [1 + LOGIT_STEPS, V] at the same positions


def chat_ids(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


@pytest.fixture(scope="module")
def engine(smollm2):
    e = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=256)))
    yield e
    e.check_leaks()


def our_greedy(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """All prompts in one batch, GREEDY_TOKENS each; logits [1 + LOGIT_STEPS, V] of the first ones."""
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"ref-{i}", p, params) for i, p in enumerate(prompts)]
    rows: dict[str, list[torch.Tensor]] = {f"ref-{i}": [] for i in range(LOGIT_PROMPTS)}
    engine.keep_logits = True
    try:
        while engine.has_unfinished():
            for row, out in enumerate(engine.step()):  # logits rows follow the step's outputs
                if len(rows.get(out.request_id, ())) <= LOGIT_STEPS and out.request_id in rows:
                    rows[out.request_id].append(engine.last_logits[row].clone())
    finally:
        engine.keep_logits = False
    return [list(s.output_ids) for s in seqs], [torch.stack(r) for r in rows.values()]


@pytest.fixture(scope="module")
def reference(engine, smollm2, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """One transformers forward per prompt over prompt + our greedy tokens (teacher forcing): its argmax
    equal to our next token everywhere is the same as its greedy generation equal to ours, and far
    cheaper than `generate` on a busy 2-core machine."""
    prompts = [chat_ids(smollm2.tokenizer, q) for q in QUESTIONS]
    ours, ours_logits = our_greedy(engine, prompts)
    hf = load_hf_gguf_model(smollm2_path(), tmp_path_factory.mktemp("smollm2"))
    ref = Reference(prompts, ours, ours_logits, [], [])
    for i, (prompt, out) in enumerate(zip(prompts, ours)):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].float()  # [64, V]
        ref.hf_next.append(logits.argmax(-1).tolist())
        if i < LOGIT_PROMPTS:
            ref.hf_logits.append(logits[:1 + LOGIT_STEPS])
    return ref


def test_logits_match_transformers_prefill_and_16_decode_steps(reference) -> None:
    assert len(reference.ours_logits) == LOGIT_PROMPTS
    for ours, expected in zip(reference.ours_logits, reference.hf_logits):
        assert ours.shape == expected.shape == (1 + LOGIT_STEPS, 49152)
        assert (ours - expected).abs().max().item() <= 1e-3


def test_greedy_64_tokens_match_transformers(reference) -> None:
    for ours, hf_next in zip(reference.ours, reference.hf_next):
        assert len(ours) == GREEDY_TOKENS and ours == hf_next


def test_capital_of_france_is_paris(engine, smollm2) -> None:
    tok = smollm2.tokenizer
    seq = engine.generate([chat_ids(tok, QUESTIONS[0])], SamplingParams(max_tokens=24, temperature=0))[0]
    assert seq.output_ids[-1] == 2  # ended by <|im_end|>, the chat template's end of turn
    assert "Paris" in tok.decode(seq.output_ids)


# --- tokenizer ---------------------------------------------------------------------------------

TEXTS = [
    "Hello world", "Once upon a time, there was a little girl named Lily.", "hello", "HELLO WORLD", "a", "",
    " ", "  ", "   ", " leading space", "  two leading spaces", "trailing spaces   ", "multiple   inner    spaces",
    "line one\nline two", "\n", "\n\n", "\n\n\nstarts with newlines", "a\n\nb", "a \n b", "tab\tseparated\tvalues",
    "\r\nwindows line ending", "12345", "3.14159", "1,000,000 dollars", "in 2024 we had 42 cats", "0x1F 0b1010 1e-9",
    "Hello, world! How are you? I'm fine; thanks.", "quotes: \"double\" and 'single'", "don't won't it's we'll they'd",
    "(parens) [brackets] {braces}", "a-b_c/d\\e|f", "#hashtag @mention $100 50% ^caret &amp *star", "~tilde `tick` <a>",
    "café", "naïve résumé", "Ünïcödé", "日本語", "日本語 café 😀", "emoji 😀🎉👍", "👨‍👩‍👧 family", "🏳️‍🌈", "Привет мир",
    "مرحبا بالعالم", "한국어 텍스트", "中文，标点。", "\u00a0non-breaking space", "zero\u200bwidth", "ﬁ ligature",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "SELECT * FROM t WHERE id=1;",
    "import numpy as np\nnp.zeros((3, 4))", "<div class=\"x\">hi</div>", "{\"key\": [1, 2, {\"a\": null}]}",
    "    indented\n        more\n", "x<|im_start|>y<|im_end|>z", "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>text after", "a<|im_end|><|im_end|>b", "<|im_start", "im_end|>", "<repo_name>pdserve",
]


def random_texts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    pieces = ["the", " cat", "Sat", " ", "  ", "\n", "\n\n", "\t", "123", "4", ".", ",", "!?", "'s", "é", "ß", "日本",
              "語", "😀", "🎉", "Ж", "def ", "()", "{}", "<|im_start|>", "<|im_end|>", "://", "_", "-", "\u00a0"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_hf_gguf_tokenizer(smollm2_path(), tmp_path_factory.mktemp("smollm2_tok"))


def test_tokenizer_matches_transformers_on_220_strings(smollm2, hf_tokenizer) -> None:
    ours = smollm2.tokenizer
    texts = TEXTS + random_texts(220 - len(TEXTS))
    assert len(texts) >= 200
    for text in texts:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids == hf_tokenizer.encode(text), text  # add_bos is false in the file
        assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special=False) == hf_tokenizer.decode(ids, skip_special_tokens=False), text


def test_special_tokens_are_single_ids_and_skipped(smollm2) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("a<|im_start|>b<|im_end|>")
    assert ids.count(1) == 1 and ids.count(2) == 1 and ids[-1] == 2
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special=False) == "a<|im_start|>b<|im_end|>"


def test_every_digit_is_its_own_token(smollm2) -> None:
    """The "smollm" pre-tokenizer splits digits one by one (llama.cpp, SmolLM's tokenizer.json)."""
    tok = smollm2.tokenizer
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
