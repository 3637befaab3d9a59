"""Streaming detokenization with stop strings, O(1) work per token.

Text of a token depends on its neighbours (sentencepiece's leading space; UTF-8 characters split over
byte-fallback tokens or, in byte-level BPE, over ordinary tokens: an emoji's four bytes may end in
the next token), so a token cannot be decoded alone. A window whose text ends in U+FFFD is held
back until the character completes (at most 4 steps). As in vLLM we keep two offsets into the ids: text up
to `read` has been accounted for, and decoding restarts at `prefix` a few tokens earlier. Each step
decodes ids[prefix:] and ids[prefix:read] and emits the difference. The window start is decoded
the same way in both, so context effects at the window's edge cancel out.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 character decodes to
_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first generated ones
_MAX_BACKOFF = 64  # how far the window may widen to find text to anchor on
_MAX_HOLDS = 4  # a UTF-8 character spans at most 4 byte tokens; more held steps mean invalid bytes


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces safe to show, cut at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Only ids a window may still reach are kept; older ones never matter again.
        self._ids: list[int] = list(prompt_ids[-(_PROMPT_CONTEXT + _MAX_BACKOFF):])
        self._prefix = max(len(self._ids) - _PROMPT_CONTEXT, 0)
        self._read = len(self._ids)
        self._holds = 0  # consecutive add() calls held back for an incomplete character
        self._held = ""  # decoded text not emitted yet: it may begin a stop string
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Text that became safe to show with these new ids ("" when nothing did)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        prefix_text, full_text = self._decode_window()
        if full_text.endswith(REPLACEMENT) and self._holds < _MAX_HOLDS:
            self._holds += 1
            return ""  # a character is still missing bytes: wait for the next token
        self._holds = 0
        new = full_text[len(prefix_text):]
        self._advance()
        return self._filter_stops(new, final=False)

    def finish(self) -> str:
        """Everything held back (an incomplete character shows as U+FFFD), up to any stop string."""
        if self.stopped:
            return ""
        prefix_text, full_text = self._decode_window()
        self._advance()
        return self._filter_stops(full_text[len(prefix_text):], final=True)

    def _decode_window(self) -> tuple[str, str]:
        """(text of ids[prefix:read], text of ids[prefix:]), with a prefix that has text in it.

        A window whose prefix decodes to nothing (only special tokens skipped, say) would let the
        decoder treat the first new token as the start of the text and drop its leading space;
        widen the window backwards until the prefix has text to anchor on.
        """
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        while not prefix_text and 0 < self._prefix and self._read - self._prefix < _MAX_BACKOFF:
            self._prefix -= 1
            prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        return prefix_text, self._tok.decode(self._ids[self._prefix:])

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        keep_from = max(self._prefix - _MAX_BACKOFF, 0)  # what a later back-off may reach
        if keep_from:
            del self._ids[:keep_from]
            self._prefix -= keep_from
            self._read -= keep_from

    def _filter_stops(self, new: str, final: bool) -> str:
        """Emit held + new text up to a stop string; keep back a tail that may start one."""
        text = self._held + new
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = 0 if final else self._partial_stop_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
