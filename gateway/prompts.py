"""From a request's prompt or chat to validated token ids.

Every check a person can fix from the error message alone happens here, before any worker is
involved, so a bad request never takes a worker's time (ValueError -> INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.tokenizer import Tokenizer


def tokenize_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """Token ids of a raw text prompt (BOS first when the model wants one)."""
    if not prompt:
        raise ValueError("prompt is empty")
    return tokenizer.encode(prompt)


def tokenize_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a chat rendered with the model's chat template; unknown roles raise ValueError."""
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    text = tokenizer.apply_chat_template(messages)
    # The template writes BOS (if any) as text, which encodes to the BOS id; don't add a second.
    bos = tokenizer.bos_id
    ids = tokenizer.encode(text, add_bos=True)
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def check_fits(prompt_ids: Sequence[int], sampling: SamplingParams, context_window: int) -> None:
    """ValueError unless the prompt plus max_tokens fits the model's context window."""
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenization")
    total = len(prompt_ids) + sampling.max_tokens
    if total > context_window:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} tokens "
            f"exceeds the model's context window of {context_window} tokens; shorten the prompt "
            f"or lower max_tokens to at most {max(context_window - len(prompt_ids), 0)}")
