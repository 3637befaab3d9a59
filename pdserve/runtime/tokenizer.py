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

Tools: a template that mentions ``tools`` (`supports_tools`; Qwen2.5's, Hermes', Llama 3.1's do,
SmolLM2's and the default do not) is rendered with ``tools=[...]`` (OpenAI's tool objects) as
transformers' ``apply_chat_template(messages, tools=...)`` renders it, and takes the messages of a
tool conversation: role ``tool`` (``tool_call_id``, ``content``) and assistant messages with
``tool_calls``. A template without tool support raises ValueError for both.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

ROLES = ("system", "user", "assistant")
TOOL_ROLES = (*ROLES, "tool")  # where the template handles tools
Message = Mapping[str, Any]  # {"role", "content"}, plus "tool_calls" / "tool_call_id" in tool conversations
Tools = Sequence[Mapping[str, Any]]  # OpenAI tool objects: {"type": "function", "function": {...}}
_MENTIONS_TOOLS = re.compile(r"\btools\b")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def encode_as_text(self, text: str) -> list[int]: ...

    @property
    def control_texts(self) -> tuple[str, ...]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    @property
    def supports_tools(self) -> bool: ...

    def apply_chat_template(self, messages: Sequence[Message], tools: Tools | None = None) -> str: ...


def template_supports_tools(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template renders tools: it refers to the `tools` variable (a template that
    never reads it would drop the tool list silently). A dict is a checkpoint's named templates."""
    if isinstance(template, Mapping):
        return any(template_supports_tools(t) for t in template.values())
    return bool(template) and _MENTIONS_TOOLS.search(template) is not None


def check_roles(messages: Sequence[Message], tools_ok: bool = False) -> None:
    """ValueError for a role the template cannot render; `tools_ok`: the template handles tool
    conversations (role "tool", assistant "tool_calls")."""
    roles = TOOL_ROLES if tools_ok else ROLES
    for i, m in enumerate(messages):
        if m.get("role") not in roles:
            hint = "; this model's chat template has no tool support" if m.get("role") == "tool" else ""
            raise ValueError(f"unsupported chat role {m.get('role')!r}; expected one of {roles}{hint}")
        if m.get("tool_calls") and not tools_ok:
            raise ValueError(f"messages[{i}] has tool_calls, but this model's chat template has no tool support")


def check_tools(tools: Tools | None, tools_ok: bool) -> None:
    if tools and not tools_ok:
        raise ValueError("tools were given, but this model's chat template has no tool support")


def default_chat_prompt(messages: Sequence[Message]) -> str:
    """The documented fallback template: "<role>: <content>\\n" per message, then "assistant:"."""
    check_roles(messages)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def render_jinja_chat_template(template: str, messages: Sequence[Message], tools: Tools | None = None,
                               **extra: Any) -> str:
    """Render a HF-style chat template in a sandbox (templates come from downloaded files), in
    the environment transformers renders it in: its `tojson` (json.dumps: Jinja's own escapes
    HTML and sorts keys, which would change a tool's JSON), loop controls, `strftime_now`;
    keys whose value is None are dropped from messages (OpenAI's `content: null`), as there."""
    from jinja2.ext import loopcontrols
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # templates call this to reject conversations
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=[_plain_message(m) for m in messages], tools=_plain_tools(tools), add_generation_prompt=True,
        **extra)


def _plain_message(m: Message) -> dict[str, Any]:
    return {k: v for k, v in m.items() if v is not None}


def _plain_tools(tools: Tools | None) -> list[dict[str, Any]] | None:
    return None if tools is None else [dict(t) for t in tools]


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

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with every special token's spelling taken as plain text; no BOS."""
        return self._as_text.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _as_text(self) -> Any:
        """A copy of the backend that encodes special tokens' spellings as text: the flag is the
        tokenizer's own, and `encode` shares the backend. Built at the first such content."""
        as_text = type(self._tok).from_str(self._tok.to_str())
        as_text.encode_special_tokens = True
        return as_text

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The spellings `encode` turns into special tokens (ChatML's `<|im_start|>`, ...)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 character decodes to U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` (grammar engines read its vocabulary)."""
        return self._tok

    @property
    def supports_tools(self) -> bool:
        return template_supports_tools(self.chat_template)

    def apply_chat_template(self, messages: Sequence[Message], tools: Tools | None = None) -> str:
        check_roles(messages, self.supports_tools)
        check_tools(tools, self.supports_tools)
        if not self.chat_template:
            return default_chat_prompt(messages)
        bos = self.id_to_piece(self.bos_id) if self.bos_id is not None else ""
        eos = self.id_to_piece(self.eos_ids[0]) if self.eos_ids else ""
        return render_jinja_chat_template(self.chat_template, messages, tools, bos_token=bos, eos_token=eos)


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

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` of transformers' fast tokenizer; ValueError for a slow one."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"this model's tokenizer ({type(self._tok).__name__}) is not a fast (Rust `tokenizers`) "
                             "tokenizer")
        return backend

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # add_special_tokens adds what this tokenizer adds (BOS for Llama, nothing for Qwen2).
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def encode_as_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        added = (t.content for t in self._tok.added_tokens_decoder.values() if t.special)
        return tuple(dict.fromkeys([*self._tok.all_special_tokens, *added]))

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    @property
    def supports_tools(self) -> bool:
        return template_supports_tools(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[Message], tools: Tools | None = None) -> str:
        check_roles(messages, self.supports_tools)
        check_tools(tools, self.supports_tools)
        if not getattr(self._tok, "chat_template", None):
            return default_chat_prompt(messages)
        return self._tok.apply_chat_template([dict(m) for m in messages], tools=_plain_tools(tools),
                                             tokenize=False, add_generation_prompt=True)
