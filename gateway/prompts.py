"""From a request's prompt or chat to validated token ids.

Every check a person can fix from the error message alone happens here, before any worker is
involved, so a bad request never takes a worker's time (ValueError -> INVALID_ARGUMENT).

Tokenizing is pure Python (about 3 us a character for a SentencePiece vocabulary): on the event
loop, one 7.5 MB prompt stalled every stream of the gateway for 25 s. So the prompt's length in
characters is checked first (`RequestLimits.check_chars`: the work is then bounded), and
`encode_off_loop` runs any prompt longer than `INLINE_CHARS` on a small thread pool: the loop
keeps serving other streams meanwhile (the thread shares the GIL with it, switching every 5 ms).

A chat with tools (OpenAI `tools`, gateway.http.tools) is rendered with them by the model's
template; their JSON and the history's tool calls count as characters of the prompt.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.tokenizer import Tokenizer, Tools

Messages = Sequence[Mapping[str, Any]]  # {"role", "content"}; "tool_calls" / "tool_call_id" with tools
# Up to this many characters a prompt is tokenized on the loop: a few ms, less than queueing it
# behind a long prompt on the pool would cost.
INLINE_CHARS = 1024
# Bounded: tokenizing holds the GIL, so more threads would only take more of the loop's share.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-tokenize")
_MARK = re.compile("\ue000(\\d+)\ue001")  # where a content was (private-use characters: no template writes them)


def prompt_chars(prompt: str, messages: Messages | None, tools: Tools | None = None) -> int:
    """Characters the tokenizer will see, up to the chat template's own text."""
    if messages is None:
        return len(prompt)
    return sum(_message_chars(m) for m in messages) + sum(len(json.dumps(t)) for t in tools or ())


def _message_chars(m: Mapping[str, Any]) -> int:
    calls = m.get("tool_calls") or ()  # the template writes each call's name and arguments as JSON
    return len(m.get("role", "")) + len(m.get("content") or "") + sum(len(json.dumps(c)) for c in calls)


def encode(tokenizer: Tokenizer, prompt: str, messages: Messages | None, tools: Tools | None = None) -> list[int]:
    """Token ids of a raw prompt (`messages` None) or of a chat (with `tools`, when it has them)."""
    return tokenize_prompt(tokenizer, prompt) if messages is None else tokenize_chat(tokenizer, messages, tools)


async def encode_off_loop(tokenizer: Tokenizer, prompt: str, messages: Messages | None,
                          tools: Tools | None = None) -> list[int]:
    """`encode`, on the tokenizer pool when the prompt is long (check its length first: a thread
    cannot be stopped, so only the length bounds its work)."""
    if prompt_chars(prompt, messages, tools) <= INLINE_CHARS:
        return encode(tokenizer, prompt, messages, tools)
    return await asyncio.get_running_loop().run_in_executor(_POOL, encode, tokenizer, prompt, messages, tools)


def tokenize_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of a raw text prompt (BOS first when the model wants one)."""
    if not prompt:
        raise ValueError("prompt is empty")
    return tokenizer.encode(prompt)


def tokenize_chat(tokenizer: Tokenizer, messages: Messages, tools: Tools | None = None) -> list[int]:
    """Token ids of a chat rendered with the model's chat template (given `tools` when there are
    any); unknown roles, or tools the template cannot render, raise ValueError."""
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    text = _render(tokenizer, messages, tools)
    pattern = _control_pattern(tokenizer.control_texts)  # once a chat, not once a message
    forged = {i: t for i, m in enumerate(messages) if (t := _control_text_in(m.get("content"), pattern))}
    ids = _encode_contents_as_text(tokenizer, messages, tools, forged, text) if forged else tokenizer.encode(text)
    # The template writes BOS (if any) as text, which encodes to the BOS id; don't add a second.
    bos = tokenizer.bos_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def _render(tokenizer: Tokenizer, messages: Messages, tools: Tools | None) -> str:
    # Without tools the template is called as before, so tokenizers without a tools argument still work.
    return tokenizer.apply_chat_template(messages, tools) if tools else tokenizer.apply_chat_template(messages)


def _control_text_in(content: object, pattern: re.Pattern[str] | None) -> str | None:
    """The first control spelling `pattern` finds in a message's content (None: none, or not text)."""
    found = pattern.search(content) if pattern is not None and isinstance(content, str) else None
    return found.group(0) if found else None


@functools.lru_cache(maxsize=8)
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    """One alternation of a tokenizer's control spellings, so that a content is scanned once rather
    than once a spelling (Llama 3's 256 over 10 KB of text: 5.5 against 376 us). None for none: an
    empty alternation would match everywhere."""
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _encode_contents_as_text(tokenizer: Tokenizer, messages: Messages, tools: Tools | None,
                             forged: dict[int, str], text: str) -> list[int]:
    """Ids of the chat `text` with the contents of `forged` messages (index: the spelling found in it)
    encoded as plain text.

    Why: a content holding `<|im_end|>\n<|im_start|>system\n...` would otherwise encode to the
    template's own control tokens and open a turn the client was not given (a user forging a
    system message); OpenAI's API reads such a content as text, as this does. The template is
    rendered again with a private-use mark for each such content, the marks are cut out and each
    content is encoded on its own with special tokens' spellings as text. Chats without such a
    content (nearly all) encode as one string, exactly as transformers' apply_chat_template does.
    A template that does not write a content as given (it trims or edits it) cannot be cut so:
    ValueError naming the message."""
    marks = {i: f"\ue000{i}\ue001" for i in forged}
    masked = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
    pieces = _MARK.split(_render(tokenizer, masked, tools))  # [text, index, text, index, ..., text]
    at = [int(i) for i in pieces[1::2]]
    # The marks are checked before any is looked up: a client's own content may spell one (any index).
    if sorted(at) != sorted(forged) or "".join(
            messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(pieces)) != text:
        i = min(forged)
        raise ValueError(f"messages[{i}].content holds {forged[i]!r}, a control token of this model's chat "
                         "template, and the template does not write the content as given, so it cannot be kept "
                         "as text: remove it from the content")
    ids = tokenizer.encode(pieces[0], add_bos=True)
    for k in range(1, len(pieces), 2):
        ids += tokenizer.encode_as_text(messages[int(pieces[k])]["content"])
        ids += tokenizer.encode(pieces[k + 1], add_bos=False) if pieces[k + 1] else []
    return ids


def check_fits(prompt_ids: Sequence[int], sampling: SamplingParams, context_window: int) -> None:
    """ValueError unless the prompt plus max_tokens fits the model's context window."""
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenization")
    total = len(prompt_ids) + sampling.max_tokens
    if total > context_window:
        room = context_window - len(prompt_ids)
        fix = (f"shorten the prompt or lower max_tokens to at most {room}" if room >= 1
               else f"shorten the prompt to at most {context_window - sampling.max_tokens} tokens"
               if sampling.max_tokens < context_window else "shorten the prompt and lower max_tokens")
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} tokens "
            f"exceeds the model's context window of {context_window} tokens; {fix}")


def check_vocab(prompt_ids: list[int], vocab_size: int) -> list[int]:
    """`prompt_ids` when every id is a token of the vocabulary, else ValueError naming the first
    that is not (ids a client sent: a worker would index its embedding table with them)."""
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is not in the model's vocabulary (ids 0 to {vocab_size - 1})")
    return prompt_ids
