"""Token-level grammar matching: which next tokens keep a sequence's output inside its
StructuredOutput spec (llguidance; see pdserve.runtime.structured_output for the specs).

    StructuredOutput ──grammar_text()──▶ llguidance grammar text
        ──GrammarCompiler.matcher() (compiled once per text, copied per sequence)──▶ GrammarMatcher
        (lives on the Sequence, on whichever worker samples)
    each step: GrammarCompiler.allowed_soon(matchers) ──one LLExecutor call for the batch, on the
        grammar thread while the forward pass runs──▶ [n, V] bool
        ──sampler: disallowed logits to -inf──▶ token ──GrammarMatcher.consume(token)

One GrammarCompiler per engine (model): it holds the model's `LLTokenizer` (built once from our
tokenizer's `tokenizers` JSON: ~0.25 s for a 49K vocabulary), the compiled grammars by text, and the
executor that fills the masks of every constrained sequence of a step in one call (in parallel,
GIL released). The model's logits may be wider than the tokenizer's vocabulary (padding rows of
the embedding): those ids are never allowed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pdserve.runtime.structured_output import StructuredOutput, grammar_text

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (a schema costs ~1 ms to compile)


class GrammarMatcher:
    """One sequence's place in its grammar: advanced over every token the sequence generates
    (on this worker or before: a prefill's first token, a resumed stream's tail)."""

    def __init__(self, matcher: Any) -> None:
        self.ll = matcher  # llguidance.LLMatcher, this sequence's own copy

    def advance(self, tokens: Seq[int]) -> None:
        """Consumes `tokens`; ValueError naming the first one the grammar refuses."""
        for i, token in enumerate(tokens):
            if not self.ll.consume_token(token):
                raise ValueError(f"token {token} (generated token {i} of {len(tokens)}) does not match the "
                                 f"structured output spec: {self.ll.get_error() or 'refused'}")

    def consume(self, token: int) -> bool:
        """Consumes one sampled token; False (the matcher then stays in its error state) when refused."""
        return self.ll.consume_token(token)

    @property
    def error(self) -> str:
        return self.ll.get_error()

    @property
    def stopped(self) -> bool:
        """The grammar is complete: no token but EOS may follow, so the sequence ends here."""
        return self.ll.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.ll.is_accepting()


class GrammarCompiler:
    """One model's grammar machinery: its LLTokenizer, compiled grammars, the batch executor."""

    def __init__(self, ll_tokenizer: Any, logits_width: int, vocab_size: int) -> None:
        import llguidance

        self.ll_tokenizer = ll_tokenizer
        self.logits_width = logits_width  # columns of the model's logits
        self.vocab_size = vocab_size  # ids the tokenizer can produce; the rest are padding
        self._words = (ll_tokenizer.vocab_size + 31) // 32  # int32 words of one bitmask row
        # Bits of ids >= vocab_size cleared: the words from _padding_word on are and-ed with this.
        self._padding_word = vocab_size // 32
        self._padding_mask = _padding_words(vocab_size, self._words)
        self._executor = llguidance.LLExecutor()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> fresh LLMatcher
        self._thread: ThreadPoolExecutor | None = None  # computes a step's masks during its forward pass

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, logits_width: int, eos_ids: Seq[int]) -> GrammarCompiler:
        """The compiler of a model with our `tokenizer` (GGUFTokenizer or HFTokenizer)."""
        import llguidance

        backend = _backend_tokenizer(tokenizer)
        vocab = backend.get_vocab_size(with_added_tokens=True)
        ll = llguidance.LLTokenizer(_backend_json(backend), n_vocab=max(vocab, logits_width),
                                    eos_token=list(eos_ids))
        return cls(ll, logits_width, min(vocab, logits_width))

    def matcher(self, so: StructuredOutput) -> GrammarMatcher:
        """A new matcher at the start of `so`; ValueError with llguidance's message when the spec
        does not compile against this model's vocabulary (e.g. it names a token id it lacks)."""
        return GrammarMatcher(self.compiled(grammar_text(so), so.kind).deep_copy())

    def compiled(self, text: str, kind: str) -> Any:
        """The fresh (never advanced) LLMatcher of grammar `text`, compiled once and kept (LRU);
        ValueError naming `kind` when it does not compile. Copy it before use (`matcher` does)."""
        import llguidance

        fresh = self._compiled.get(text)
        if fresh is not None:
            self._compiled.move_to_end(text)
            return fresh
        fresh = llguidance.LLMatcher(self.ll_tokenizer, text, log_level=0)
        if fresh.is_error():
            raise ValueError(f"the {kind} cannot be compiled: {fresh.get_error()}")
        self._compiled[text] = fresh
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return fresh

    def allowed_soon(self, matchers: Seq[GrammarMatcher | None], eos_ids: Seq[Seq[int]] = ()
                     ) -> Future[torch.Tensor]:
        """`allowed`, computed on this compiler's thread; the matchers must not change until it is done."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._thread.submit(self.allowed, list(matchers), list(eos_ids))

    def allowed(self, matchers: Seq[GrammarMatcher | None], eos_ids: Seq[Seq[int]] = ()) -> torch.Tensor:
        """[n, logits_width] bool: the tokens each matcher allows next (every token for None).
        `eos_ids[i]`: EOS ids to take out of row i (ignore_eos) unless nothing else is allowed.
        A row left empty (a matcher in an error state) allows EOS only, so its sequence ends.

        The edits are made on the packed words in numpy: torch's parallel kernels over [n, V] cost
        more in thread hand-offs than the work itself on a busy CPU."""
        n = len(matchers)
        bitmask = torch.full((n, self._words), -1, dtype=torch.int32)  # [n, W]: unconstrained rows all ones
        constrained = [(m.ll, i) for i, m in enumerate(matchers) if m is not None]
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing that module:
        # its torch.compile decorator costs seconds at import.
        self._executor.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), self._words * 4, n)
        words = bitmask.numpy().view(np.uint32)  # [n, W], shares the tensor's memory
        words[:, self._padding_word:] &= self._padding_mask  # ids past the tokenizer's vocabulary
        for i, ids in enumerate(eos_ids):
            if ids and matchers[i] is not None:
                _clear_unless_empty(words[i], ids)
        for i in np.flatnonzero(~words.any(axis=1)):
            _set_bit(words[i], self.ll_tokenizer.eos_token)
        return unpack_bitmask(bitmask, self.logits_width)


def _set_bit(row: np.ndarray, token: int) -> None:
    row[token // 32] |= np.uint32(1 << (token % 32))


def _clear_unless_empty(row: np.ndarray, tokens: Seq[int]) -> None:
    """Clears the bits of `tokens` in one packed row, unless no other bit is set."""
    kept = row.copy()
    for t in tokens:
        row[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    if not row.any():
        row[:] = kept


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bitmask: [n, W] int32, bit k of word w = token 32w + k -> [n, width] bool (missing bits False).

    numpy's unpackbits over the little-endian bytes: ~0.1 ms for 32 rows of a 49K vocabulary, where
    shifting the int32 words in torch takes tens of ms."""
    n, words = bitmask.shape
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [n, 32W] of 0/1
    flat = torch.from_numpy(bits.view(np.bool_))
    if flat.shape[1] >= width:
        return flat[:, :width]
    out = torch.zeros(n, width, dtype=torch.bool)
    out[:, :flat.shape[1]] = flat
    return out


def _padding_words(vocab_size: int, words: int) -> np.ndarray:
    """uint32 words from word vocab_size // 32 on, with the bits of ids below vocab_size set."""
    first = vocab_size // 32
    out = np.zeros(max(words - first, 0), dtype=np.uint32)
    if out.size and vocab_size % 32:
        out[0] = np.uint32((1 << (vocab_size % 32)) - 1)
    return out


def _backend_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind our tokenizer (runtime.tokenizer's `backend`)."""
    try:
        return tokenizer.backend
    except (AttributeError, ValueError) as err:
        raise ValueError(f"structured output needs a fast (Rust `tokenizers`) tokenizer: {err}") from None


def _backend_json(backend: Any) -> str:
    """The tokenizer's JSON without padding or truncation (llguidance reads every token's bytes)."""
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
