"""Tokenizers behind one protocol: GGUF vocabularies and HF checkpoint directories.

`GGUFTokenizer` runs the `tokenizers` library over the vocabulary stored in a GGUF file, built by
`pdserve.runtime.gguf_vocab` as transformers' GGUF conversion builds it (sentencepiece ``llama`` and
byte-level BPE ``gpt2`` vocabularies alike; the tests check it token for token). `HFTokenizer` wraps
transformers' tokenizer of an HF directory. Both: special tokens written in text stay one id, and
decoding with `skip_special` leaves them out.

Chat prompts: a checkpoint's own Jinja chat template is used when it has one (rendered with
`add_generation_prompt=True`). Without one the default is, per message, ``"<role>: <content>\\n"``,
then ``"assistant:"``; e.g. ``[{"role": "user", "content": "Hi"}]`` gives ``"user: Hi\\nassistant:"``.
Roles other than system, user and assistant raise ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant")


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
    """A GGUF file's vocabulary behind our Tokenizer protocol: a `tokenizers.Tokenizer` built by
    `gguf_vocab.build_tokenizer` (sentencepiece or byte-level BPE), plus the file's special ids."""

    def __init__(self, backend: Any, bos_id: int | None, eos_ids: Sequence[int], unk_id: int | None = None,
                 add_bos: bool = True, chat_template: str | None = None) -> None:
        self._tok = backend  # tokenizers.Tokenizer
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.unk_id = unk_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when asked and the vocabulary wants one."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 character decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        check_roles(messages)
        if not self.chat_template:
            return default_chat_prompt(messages)
        bos = self.id_to_piece(self.bos_id) if self.bos_id is not None else ""
        eos = self.id_to_piece(self.eos_ids[0]) if self.eos_ids else ""
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
