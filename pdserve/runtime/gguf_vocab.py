"""A GGUF file's vocabulary -> a `tokenizers.Tokenizer`, the way transformers' GGUF conversion builds it.

Two vocabulary models are supported (``tokenizer.ggml.model``):

- ``llama``: sentencepiece. A BPE over the pieces with byte fallback (``<0xNN>`` tokens), merges
  recovered from the piece scores (best-scored merged piece first), spaces as "▁" with one "▁" put
  in front of the text (Metaspace "first"); decoding strips that one space again.
- ``gpt2``: byte-level BPE with the file's merges. Text is split by the pre-tokenizer named in
  ``tokenizer.ggml.pre`` (llama.cpp's names, `PRE_TOKENIZERS`), then each piece is spelled in the
  GPT-2 byte alphabet and merged.

In both, tokens the file marks CONTROL (``<|im_start|>``, ``</s>``) or UNKNOWN become special added
tokens and USER_DEFINED ones plain added tokens: written literally in text they stay one id and are
never split. Decoding with ``skip_special_tokens`` leaves the special ones out.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # "▁", sentencepiece's visible space

# Split regexes of llama.cpp's pre-tokenizers (llama-vocab.cpp), as transformers spells them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own regex


def _regex_split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _smollm_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's "smollm": every digit alone ("\p{N}"), then GPT-2's regex, as SmolLM's own
    # tokenizer.json (Digits(individual_digits) + ByteLevel). transformers' GGUF conversion leaves the
    # digit split out (it knows no "smollm"): it cuts whitespace before a digit otherwise ("  4" gives
    # " ", " ", "4" there, "  ", "4" here); tests/test_smollm2.py shows it.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


PRE_TOKENIZERS = {
    "default": _gpt2_split, "gpt2": _gpt2_split, "smollm": _smollm_split,
    "llama-bpe": lambda: _regex_split(_LLAMA3_SPLIT), "llama3": lambda: _regex_split(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_split(_QWEN2_SPLIT),
}


class VocabError(ValueError):
    """The vocabulary uses a model or pre-tokenizer that is not supported."""


def build_tokenizer(model: str, tokens: Sequence[str], token_types: Sequence[int], *,
                    scores: Sequence[float] = (), merges: Sequence[str] = (),
                    pre: str | None = None) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a GGUF vocabulary; no BOS/EOS is added by it."""
    types = list(token_types) if len(token_types) else [NORMAL] * len(tokens)
    if model == "llama":
        tok = _sentencepiece(tokens, scores if len(scores) else [0.0] * len(tokens))
    elif model == "gpt2":
        tok = _byte_level(tokens, merges, pre)
    else:
        raise VocabError(f"unsupported GGUF tokenizer model {model!r} (supported: 'llama', 'gpt2')")
    _add_special_tokens(tok, tokens, types, byte_level=model == "gpt2")
    return tok


def _sentencepiece(tokens: Sequence[str], scores: Sequence[float]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges_from_scores(vocab, dict(zip(tokens, scores))),
                     fuse_unk=True, byte_fallback=True, dropout=None)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-scored merged piece first (transformers'
    `generate_merges`: ties by shorter left, then shorter right part, then by ids)."""
    found = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        found += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _byte_level(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> Tokenizer:
    make_pre = PRE_TOKENIZERS.get(pre or "default")
    if make_pre is None:
        raise VocabError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(PRE_TOKENIZERS)})")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = _byte_spelling()
    # Tokens outside the byte alphabet (rare mislabels) are respelled, as transformers does.
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character map (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _add_special_tokens(tok: Tokenizer, tokens: Sequence[str], types: Sequence[int], byte_level: bool) -> None:
    """CONTROL/UNKNOWN tokens as special, USER_DEFINED as plain added tokens: matched whole in text."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    special = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty in (CONTROL, UNKNOWN) and t and (alphabet is None or set(t) <= alphabet)]
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
