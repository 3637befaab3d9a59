"""IncrementalDetokenizer: streamed text against one full decode, stop strings, flushing."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from hf_reference import load_hf_gguf_tokenizer
from pdserve.runtime.detokenizer import IncrementalDetokenizer
from pdserve.runtime.gguf_reader import load_gguf_tokenizer
from pdserve.runtime.tokenizer import HFTokenizer, Tokenizer

GGUF = Path(__file__).resolve().parent / "fixtures/stories260K/stories260K.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"test model {GGUF} not present")

TEXTS = [
    "Once upon a time, there was a little girl named Lily. She liked to play.",
    "日本語 café 😀", "emoji 😀🎉👍 and more 日本", "  spaced   out  text \n\n new lines\n",
    "Tim said \"Let's go!\" and ran.\nThe end.", "Ünïcödé naïve résumé", "a", "😀",
]


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    return load_gguf_tokenizer(GGUF)


@pytest.fixture(scope="module")
def bpe_tok() -> Tokenizer:
    """SmolLM2's byte-level BPE (a character's bytes spread over tokens, no leading-space rule)."""
    from conftest import smollm2_path

    return load_gguf_tokenizer(smollm2_path())


@pytest.fixture(scope="module", params=["gguf", "hf", "bpe"])
def tok(request: pytest.FixtureRequest, gguf_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    if request.param == "gguf":
        return gguf_tok
    if request.param == "bpe":
        return request.getfixturevalue("bpe_tok")
    tmp = tmp_path_factory.mktemp("hf_tok")
    load_hf_gguf_tokenizer(GGUF, tmp).save_pretrained(tmp / "dir")
    return HFTokenizer.from_directory(tmp / "dir")


def reference(tok: Tokenizer, prompt: Sequence[int], generated: Sequence[int], stop: Sequence[str] = ()) -> str:
    """What the stream must add up to: the full decode minus the prompt's, cut at the first stop."""
    full = tok.decode([*prompt, *generated])
    prompt_text = tok.decode(prompt)
    assert full.startswith(prompt_text)
    text = full[len(prompt_text):]
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def stream(tok: Tokenizer, prompt: Sequence[int], generated: Sequence[int], stop: Sequence[str] = (),
           chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, stop)
    pieces = [detok.add(generated[i:i + chunk]) for i in range(0, len(generated), chunk)]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode(tok: Tokenizer, chunk: int) -> None:
    prompts = [tok.encode(""), tok.encode("Once upon a time"), tok.encode("日本"), tok.encode("x " * 40)]
    for prompt in prompts:
        for text in TEXTS:
            generated = tok.encode(text, add_bos=False)
            pieces, _ = stream(tok, prompt, generated, chunk=chunk)
            assert "".join(pieces) == reference(tok, prompt, generated), (prompt, text)


def test_split_characters_are_held_back(gguf_tok: Tokenizer) -> None:
    prompt = gguf_tok.encode("Hi")
    generated = gguf_tok.encode("日本語 café 😀", add_bos=False)
    detok = IncrementalDetokenizer(gguf_tok, prompt)
    pieces = [detok.add([t]) for t in generated]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # byte tokens of an unfinished character emitted nothing
    assert "".join(pieces) + detok.finish() == " 日本語 café 😀"


def test_random_token_sequences(gguf_tok: Tokenizer) -> None:
    """Random ids, byte tokens included: text may be invalid UTF-8, the stream must still add up."""
    rng = random.Random(7)
    for _ in range(200):
        prompt = [1] + [rng.randrange(3, 512) for _ in range(rng.randint(0, 8))]
        generated = [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]
        pieces, _ = stream(gguf_tok, prompt, generated)
        full = gguf_tok.decode([*prompt, *generated])
        prompt_text = gguf_tok.decode(prompt)
        if not prompt_text.endswith("\ufffd") and full.startswith(prompt_text):
            assert_same_text("".join(pieces), full[len(prompt_text):])


def assert_same_text(streamed: str, full: str) -> None:
    """Equal, but where the full decode has U+FFFD: `tokenizers` (ByteFallback) replaces every byte of
    a run of byte tokens that is not valid UTF-8, an ASCII byte among them too; a window that cuts
    the run apart shows that byte. Only random (invalid) bytes differ so; valid text is exact."""
    assert len(streamed) == len(full), (streamed, full)
    assert all(a == b or b == "\ufffd" for a, b in zip(streamed, full)), (streamed, full)


def test_special_tokens_inside_generation(gguf_tok: Tokenizer) -> None:
    # EOS mid-stream (ignore_eos) is skipped; the space of the token after it must survive.
    prompt = gguf_tok.encode("Once")
    generated = [*gguf_tok.encode(" upon", add_bos=False), 2, 2, *gguf_tok.encode(" a time", add_bos=False)]
    pieces, _ = stream(gguf_tok, prompt, generated)
    assert "".join(pieces) == reference(gguf_tok, prompt, generated) == " upon a time"


def test_prompt_of_only_bos(gguf_tok: Tokenizer) -> None:
    generated = gguf_tok.encode("Hello there", add_bos=False)
    pieces, _ = stream(gguf_tok, [1], generated)
    assert "".join(pieces) == "Hello there"


STOP_CASES = [
    ("Once upon a time, there was a girl. The end. More text", ["The end"]),
    ("Once upon a time, there was a girl.", ["time,", "girl"]),
    ("Once upon a time, there was a girl.", ["girl", "time,"]),  # earliest wins, not first listed
    ("abc\n\ndef", ["\n\n"]),
    ("She said 日本語 then left", ["本"]),  # stop inside a byte-fallback character run
    ("no stop here at all", ["zzz", "allx"]),
    ("ends with a partial st", ["stop"]),  # held back, then flushed by finish()
    ("upon", ["upon"]),  # the very first text is a stop
]


@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
def test_stop_strings(tok: Tokenizer, text: str, stop: list[str]) -> None:
    prompt = tok.encode("Story:")
    generated = tok.encode(text, add_bos=False)
    pieces, detok = stream(tok, prompt, generated, stop)
    expected = reference(tok, prompt, generated, stop)
    assert "".join(pieces) == expected
    assert detok.stopped == (expected != reference(tok, prompt, generated))


def test_partial_stop_is_held_then_released(gguf_tok: Tokenizer) -> None:
    stop = "The end."
    detok = IncrementalDetokenizer(gguf_tok, gguf_tok.encode("x"), stop=[stop])
    shown = ""
    for t in gguf_tok.encode(" The ending was happy", add_bos=False):
        shown += detok.add([t])
        # Never shown: a tail that could still grow into the stop string.
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop)))
    assert shown + detok.finish() == " The ending was happy" and not detok.stopped


def test_stop_cut_inside_a_token(gguf_tok: Tokenizer) -> None:
    prompt = gguf_tok.encode("x")
    generated = gguf_tok.encode(" Lily was happy", add_bos=False)
    detok = IncrementalDetokenizer(gguf_tok, prompt, stop=["ily w"])
    out = "".join(detok.add([t]) for t in generated)
    assert detok.stopped and out == " L"
    assert detok.add(gguf_tok.encode(" more", add_bos=False)) == "" and detok.finish() == ""


def test_finish_flushes_incomplete_character(gguf_tok: Tokenizer) -> None:
    ids = gguf_tok.encode("😀", add_bos=False)  # "▁" then four byte tokens
    detok = IncrementalDetokenizer(gguf_tok, [1])
    shown = "".join(detok.add([t]) for t in ids[:-1])
    assert "\ufffd" not in shown
    assert shown + detok.finish() == gguf_tok.decode([1, *ids[:-1]])


def test_byte_level_characters_split_over_tokens(bpe_tok: Tokenizer) -> None:
    """Emoji and CJK whose UTF-8 bytes byte-level BPE cuts between tokens: nothing shows half a character."""
    text = " 日本語 😀🎉 👨‍👩‍👧 한국어 ∑"
    generated = bpe_tok.encode(text)
    assert any("\ufffd" in bpe_tok.decode([t]) for t in generated)  # some token is part of a character
    detok = IncrementalDetokenizer(bpe_tok, bpe_tok.encode("Hi"))
    pieces = [detok.add([t]) for t in generated]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.finish() == text


def test_byte_level_special_tokens_mid_stream(bpe_tok: Tokenizer) -> None:
    prompt = bpe_tok.encode("<|im_start|>assistant\n")
    generated = [*bpe_tok.encode("Paris."), 2, *bpe_tok.encode(" Done")]  # 2 is <|im_end|>
    pieces, _ = stream(bpe_tok, prompt, generated)
    assert "".join(pieces) == "Paris. Done"
