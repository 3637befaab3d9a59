"""A checkpoint's weights, each read from its file when first asked for, then kept.

Why: an engine that serves a GGUF's 4-bit projections from their codes (`int4-exact`, `int4`) never
uses their dequantized weights, and a worker's load spent 1.7 s of its start (SmolLM2, 2-core Zen 3
EPYC) and ~430 MB of its peak memory dequantizing them to fp32 only to drop them (the prefill
worker's dense copy is dequantized from the codes, `Int4Linear.keep_dense_copy`). Everything that
reads a weight gets the tensor the eager load gave (tests/test_lazy_weights.py); a pipeline stage
reads only its layers. The file stays mapped (its pages are the page cache's, read when touched)
while the mapping lives: a worker drops its checkpoint once its engine is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class _Unread:
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


class LazyWeights(MutableMapping):
    """name -> tensor; `loaders` gives each name's shape and the function that reads it."""

    def __init__(self, loaders: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]) -> None:
        # In the file's order; a name maps to its tensor once read, to an _Unread before.
        self._entries: dict[str, torch.Tensor | _Unread] = {n: _Unread(*entry) for n, entry in loaders.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]  # KeyError for a name the file does not hold
        if isinstance(entry, _Unread):
            entry = self._entries[name] = entry.load()
        return entry

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""
        entry = self._entries[name]
        return entry.shape if isinstance(entry, _Unread) else tuple(entry.shape)

    @property
    def loaded(self) -> frozenset[str]:
        """The names read so far (tests, and the log of what a load did)."""
        return frozenset(n for n, e in self._entries.items() if not isinstance(e, _Unread))


def shape_of(weights: MutableMapping, name: str) -> tuple[int, ...]:
    """A weight's shape; a lazy one's without reading it."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
