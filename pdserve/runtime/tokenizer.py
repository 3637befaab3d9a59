"""Tokenizers: our own sentencepiece-style one for GGUF vocabularies, and a wrapper of transformers'.

`GGUFTokenizer` implements llama.cpp's "SPM" algorithm over the vocabulary stored in a GGUF file
(tokens, scores, token types). It follows what transformers' tokenizer built from the same file does,
which the tests check token for token:

- text is cut at control and user-defined tokens written literally (``"</s>"`` becomes the EOS id);
- in each piece spaces become "▁", and the first piece of the text gets one "▁" in front unless it
  already starts with a space (transformers' Metaspace "first" scheme; llama.cpp always prepends);
- adjacent symbols merge greedily, best-scored merged token first, leftmost on ties;
- a symbol left outside the vocabulary becomes its UTF-8 bytes as `<0xNN>` tokens (or unk).

Decoding maps "▁" back to spaces and byte tokens back to bytes, decodes UTF-8 with
errors="replace", and drops the one space sentencepiece put in front of the text. With
`skip_special` the control tokens (bos, eos, unk) are left out; otherwise they are written as text.

Chat prompts: a checkpoint's own Jinja chat template is used when it has one (rendered with
`add_generation_prompt=True`). Without one the default is, per message, ``"<role>: <content>\\n"``,
then ``"assistant:"``; e.g. ``[{"role": "user", "content": "Hi"}]`` gives ``"user: Hi\\nassistant:"``.
Roles other than system, user and assistant raise ValueError.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant")
SPACE = "\u2581"  # "▁", sentencepiece's visible space

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str: ...


def check_roles(messages: Sequence[Mapping[str, str]]) -> None:
    for m in messages:
        if m.get("role") not in ROLES:
            raise ValueError(f"unsupported chat role {m.get('role')!r}; expected one of {ROLES}")


def default_chat_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The documented fallback template: "<role>: <content>\\n" per message, then "assistant:"."""
    check_roles(messages)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def render_jinja_chat_template(template: str, messages: Sequence[Mapping[str, str]], **extra: Any) -> str:
    """Render a HF-style chat template in a sandbox (templates come from downloaded files)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # templates call this to reject conversations
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=[dict(m) for m in messages], add_generation_prompt=True, **extra)


class GGUFTokenizer:
    """Sentencepiece (llama "SPM") tokenizer over a GGUF vocabulary."""

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                 bos_id: int | None, eos_ids: Sequence[int], unk_id: int | None = None,
                 add_bos: bool = True, chat_template: str | None = None) -> None:
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._pieces = list(tokens)
        self._types = list(token_types) if len(token_types) else [NORMAL] * len(tokens)
        # Only normal and user-defined pieces are produced by merging (sentencepiece's rule).
        self._mergeable = {t: (float(scores[i]), i) for i, t in enumerate(tokens)
                           if self._types[i] in (NORMAL, USER_DEFINED)}
        self._byte_ids = self._find_byte_tokens()
        self._byte_of = {i: b for b, i in enumerate(self._byte_ids) if i is not None}
        # Pieces written literally in the text that stand for one token, longest first.
        literal = {t: i for i, t in enumerate(tokens) if self._types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and t}
        self._literal_ids = literal
        self._literal_re = (re.compile("|".join(re.escape(t) for t in sorted(literal, key=len, reverse=True)))
                            if literal else None)
        self._special = {i for i, ty in enumerate(self._types) if ty in (CONTROL, UNKNOWN)}

    def _find_byte_tokens(self) -> list[int | None]:
        ids: list[int | None] = [None] * 256
        for i, (piece, ty) in enumerate(zip(self._pieces, self._types)):
            m = _BYTE_PIECE.fullmatch(piece)
            if ty == BYTE and m:
                ids[int(m.group(1), 16)] = i
        return ids

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when asked and the vocabulary wants one."""
        ids: list[int] = [self.bos_id] if add_bos and self.add_bos and self.bos_id is not None else []
        pos = 0
        for m in self._literal_re.finditer(text) if self._literal_re else ():
            ids += self._encode_piece(text[pos:m.start()], first=pos == 0)
            ids.append(self._literal_ids[m.group()])
            pos = m.end()
        ids += self._encode_piece(text[pos:], first=pos == 0)
        return ids

    def _encode_piece(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        text = text.replace(" ", SPACE)
        if first and not text.startswith(SPACE):
            text = SPACE + text  # add_dummy_prefix, once, as transformers does
        ids: list[int] = []
        for symbol in self._merge(text):
            ids += self._symbol_ids(symbol)
        return ids

    def _merge(self, text: str) -> list[str]:
        """Greedy best-score pair merging (llama.cpp's SPM); O(n log n) with a heap."""
        sym = list(text)  # symbol i starts at char i; merged-away symbols become ""
        nxt = list(range(1, len(sym) + 1))
        prv = list(range(-1, len(sym) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int) -> None:
            if left < 0 or nxt[left] >= len(sym):
                return
            right = nxt[left]
            merged = sym[left] + sym[right]
            if merged in self._mergeable:
                # Best score first, then leftmost: the order llama.cpp's priority queue uses.
                heapq.heappush(heap, (-self._mergeable[merged][0], left, right, merged))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if nxt[left] != right or sym[left] + sym[right] != merged:
                continue  # stale: one side was merged with something else since
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[left] < len(sym):
                prv[nxt[left]] = left
            push(prv[left])
            push(left)
        return [s for s in sym if s]

    def _symbol_ids(self, symbol: str) -> list[int]:
        if symbol in self._mergeable:
            return [self._mergeable[symbol][1]]
        out = []
        for b in symbol.encode("utf-8"):  # byte fallback
            bid = self._byte_ids[b]
            if bid is None:
                if self.unk_id is None:
                    raise ValueError(f"cannot encode {symbol!r}: no byte token and no unk token")
                return [self.unk_id]
            out.append(bid)
        return out

    # --- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; the space sentencepiece put in front of the text is removed."""
        buf = bytearray()
        for i in ids:
            if i in self._byte_of:
                buf.append(self._byte_of[i])
            elif skip_special and i in self._special:
                continue
            else:
                buf += self._pieces[i].replace(SPACE, " ").encode("utf-8")
        text = buf.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text

    def id_to_piece(self, token_id: int) -> str:
        return self._pieces[token_id]

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        check_roles(messages)
        if not self.chat_template:
            return default_chat_prompt(messages)
        bos = self._pieces[self.bos_id] if self.bos_id is not None else ""
        eos = self._pieces[self.eos_ids[0]] if self.eos_ids else ""
        return render_jinja_chat_template(self.chat_template, messages, bos_token=bos, eos_token=eos)


class HFTokenizer:
    """transformers' tokenizer of a HF checkpoint directory, behind our Tokenizer protocol."""

    def __init__(self, hf_tokenizer: Any, eos_ids: Sequence[int] = ()) -> None:
        self._tok = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.bos_id = hf_tokenizer.bos_token_id
        eos = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self.eos_ids = tuple(dict.fromkeys([*eos_ids, *eos]))  # config's first, no duplicates

    @classmethod
    def from_directory(cls, path: str | Path, eos_ids: Sequence[int] = ()) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), eos_ids)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # add_special_tokens adds what this tokenizer adds (BOS for Llama, nothing for Qwen2).
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        check_roles(messages)
        if not getattr(self._tok, "chat_template", None):
            return default_chat_prompt(messages)
        return self._tok.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
