"""GGUFTokenizer against transformers' tokenizer built from the same GGUF vocabulary."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hf_reference import load_hf_gguf_tokenizer
from pdserve.runtime.gguf_reader import load_gguf_tokenizer
from pdserve.runtime.tokenizer import GGUFTokenizer, HFTokenizer, Tokenizer, default_chat_prompt

GGUF = Path(__file__).resolve().parent / "fixtures/stories260K/stories260K.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"test model {GGUF} not present")

TEXTS = [
    "Hello world", "Once upon a time, there was a little girl named Lily.",
    "She liked to play outside in the sun.", "The cat sat on the mat. The dog barked!",
    "hello", "Hello", "HELLO WORLD", "a", "I", "",
    " ", "  ", " leading space", "  two leading spaces", "trailing space ", "trailing spaces   ",
    "multiple   inner    spaces", " both ends ",
    "line one\nline two", "\n", "\n\nstarts with newlines", "ends with newline\n", "a\n\nb", "tab\tseparated\tvalues",
    "\r\nwindows line ending", "12345", "3.14159", "1,000,000 dollars", "in 2024 we had 42 cats",
    "Hello, world! How are you? I'm fine; thanks.", "quotes: \"double\" and 'single'", "(parens) [brackets] {braces}",
    "a-b_c/d\\e|f", "#hashtag @mention $100 50% ^caret &amp *star", "~tilde `backtick` <angle>",
    "café", "naïve résumé", "Ünïcödé", "héllo wörld", "日本語", "日本語 café 😀", "emoji 😀🎉👍", "👨‍👩‍👧 family",
    "Привет мир", "مرحبا", "한국어 텍스트", "\u00a0non-breaking space", "zero\u200bwidth",
    "hello</s>world", "<s>starts with bos", "ends with unk<unk>", "Tim said \"Let's go!\" and ran away.",
]


@pytest.fixture(scope="module")
def ours() -> GGUFTokenizer:
    return load_gguf_tokenizer(GGUF)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory):
    return load_hf_gguf_tokenizer(GGUF, tmp_path_factory.mktemp("hf_gguf"))


def test_protocol_and_special_ids(ours: GGUFTokenizer) -> None:
    assert isinstance(ours, Tokenizer)
    assert (ours.vocab_size, ours.bos_id, ours.eos_ids, ours.unk_id) == (512, 1, (2,), 0)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: GGUFTokenizer, hf, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours: GGUFTokenizer, hf, text: str) -> None:
    ids = hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.startswith(" ") and "<" not in t])
def test_round_trip(ours: GGUFTokenizer, text: str) -> None:
    assert ours.decode(ours.encode(text)) == text


def test_random_strings_match_transformers(ours: GGUFTokenizer, hf) -> None:
    rng = random.Random(1234)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ  \n\t.,!?'\"0123456789éüß日本語😀"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_long_text_matches_transformers(ours: GGUFTokenizer, hf) -> None:
    text = " ".join(TEXTS) * 20  # ~20k chars: the heap-based merge keeps this fast
    assert ours.encode(text) == hf.encode(text)


def test_byte_fallback_tokens(ours: GGUFTokenizer) -> None:
    ids = ours.encode("日", add_bos=False)
    assert [ours.id_to_piece(i) for i in ids] == ["▁", "<0xE6>", "<0x97>", "<0xA5>"]
    # An incomplete character decodes to U+FFFD rather than failing.
    assert ours.decode(ids[:2]) == "\ufffd"


def test_default_chat_prompt(ours: GGUFTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell a story."}]
    expected = "system: Be brief.\nuser: Hi\nassistant: Hello.\nuser: Tell a story.\nassistant:"
    assert ours.apply_chat_template(messages) == expected == default_chat_prompt(messages)


def test_chat_rejects_unknown_role(ours: GGUFTokenizer) -> None:
    with pytest.raises(ValueError, match="tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_jinja_chat_template_matches_transformers(hf, tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi there"}]
    hf.chat_template = TEMPLATE
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        hf.save_pretrained(tmp_path)
    finally:
        hf.chat_template = None
    gguf_tok = load_gguf_tokenizer(GGUF)
    gguf_tok.chat_template = TEMPLATE
    assert gguf_tok.apply_chat_template(messages) == expected
    assert HFTokenizer.from_directory(tmp_path).apply_chat_template(messages) == expected


def test_hf_tokenizer_wrapper(ours: GGUFTokenizer, hf, tmp_path: Path) -> None:
    hf.save_pretrained(tmp_path)
    wrapped = HFTokenizer.from_directory(tmp_path, eos_ids=(2,))
    assert isinstance(wrapped, Tokenizer)
    assert (wrapped.vocab_size, wrapped.bos_id, wrapped.eos_ids) == (512, 1, (2,))
    for text in TEXTS[:20]:
        assert wrapped.encode(text) == ours.encode(text)
        assert wrapped.decode(wrapped.encode(text)) == ours.decode(ours.encode(text))
    assert wrapped.apply_chat_template([{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant:"


# --- byte-level BPE (GGUF "gpt2") pre-tokenizers ------------------------------------------------

PRE_TEXTS = ["Hello world", "in 2024 we had 42 cats, 1234567 of them", "don't WE'LL it's", "  a\n\n\n  b   ",
             "日本語 café 😀", "x<|im_start|>y<|im_end|>z", "def f(x):\n    return x**2\n", "a  4 \n\n5",
             "\u00a0non-breaking", "Привет, мир!", "tab\t\tend\r\n"]


def vocab_only_gguf(path: Path, pre: str) -> Path:
    """SmolLM2's byte-level vocabulary and merges under another `tokenizer.ggml.pre`, no tensors."""
    from conftest import smollm2_tokenizer_fields

    return _write_vocab(path, pre, smollm2_tokenizer_fields())


SMALL_VOCAB = 4096  # of SmolLM2's tokens in small_vocab_gguf


def small_vocab_gguf(path: Path, pre: str) -> Path:
    """A byte-level BPE of ~5k tokens under `pre`, no tensors: SmolLM2's first SMALL_VOCAB tokens
    (its ids follow its merge order, so they and its first merges are the BPE those merges learn:
    the specials, bytes, spaces, common words), and every number of two or three digits as one token.
    SmolLM2 splits digits one by one and has no such token, so with its own vocabulary "llama-bpe"
    (up to three digits a piece) and "qwen2" (one) encode every text alike; here they do not.
    Reading and building this is ~10x cheaper than the whole 49k vocabulary, with the same split
    regexes and BPE code on both sides."""
    from dataclasses import replace

    from conftest import smollm2_tokenizer_fields

    fields = smollm2_tokenizer_fields()
    tokens, types, merges = (fields[f"tokenizer.ggml.{k}"].value for k in ("tokens", "token_type", "merges"))
    first = len(tokens) - len(merges)  # the tokens no merge makes; merge i makes token first + i
    tokens, types, merges = tokens[:SMALL_VOCAB], types[:SMALL_VOCAB], merges[:SMALL_VOCAB - first]
    assert {m.replace(" ", "") for m in merges} <= set(tokens), "merges whose token is not kept"
    digits = "0123456789"
    numbers = [(a, b) for a in digits for b in digits] + [(a + b, c) for a in digits for b in digits for c in digits]
    assert not {a + b for a, b in numbers} & set(tokens)
    tokens, types = tokens + [a + b for a, b in numbers], types + [1] * len(numbers)  # 1: NORMAL
    merges = merges + [f"{a} {b}" for a, b in numbers]
    arrays = {"tokens": tokens, "token_type": types, "merges": merges}
    small = {**fields, **{f"tokenizer.ggml.{k}": replace(fields[f"tokenizer.ggml.{k}"], value=v) for k, v in arrays.items()}}
    return _write_vocab(path, pre, small)


def _write_vocab(path: Path, pre: str, fields: dict) -> Path:
    """A GGUF of `fields`' `tokenizer.ggml.*` keys with `pre` as its pre-tokenizer, no tensors."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    for name, field in fields.items():
        if name.startswith("tokenizer.ggml.") and name != "tokenizer.ggml.pre":
            w.add_key_value(name, field.value, field.type, sub_type=field.sub_type)
    w.add_string("tokenizer.ggml.pre", pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# "gpt2" and "default" (GPT-2's regex): tests/test_smollm2.py, against the file's own transformers tokenizer.
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    path = small_vocab_gguf(tmp_path / f"{pre}.gguf", pre)
    ours = load_gguf_tokenizer(path)
    hf = load_hf_gguf_tokenizer(path, tmp_path / "patched")
    for text in PRE_TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # What tells the two regexes apart in this vocabulary: "2024" is cut into "202", "4" (then merged
    # within those) or into four digits, which no merge joins again.
    pieces = [ours.id_to_piece(i) for i in ours.encode("in 2024")]
    assert any(len(p) > 1 and p.isdigit() for p in pieces) == (pre == "llama-bpe"), pieces


def test_unsupported_pre_tokenizer_is_one_line(tmp_path: Path) -> None:
    from pdserve.runtime.loader import ModelLoadError

    path = small_vocab_gguf(tmp_path / "odd.gguf", "made-up")
    with pytest.raises(ModelLoadError, match=r"odd\.gguf: unsupported GGUF pre-tokenizer 'made-up' \(supported: "):
        load_gguf_tokenizer(path)
