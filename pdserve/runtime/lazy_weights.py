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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LazyWeights(MutableMapping):
    """name -> tensor; `loaders` gives each name's shape and the function that reads it."""

    def __init__(self, loaders: dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]) -> None:
        self._pending = dict(loaders)
        self._loaded: dict[str, torch.Tensor] = {}
        self._order = list(loaders)  # the file's order, kept for iteration

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._loaded:
            _, load = self._pending[name]  # KeyError for a name the file does not hold
            self._loaded[name] = load()
            del self._pending[name]
        return self._loaded[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if name not in self._pending and name not in self._loaded:
            self._order.append(name)
        self._pending.pop(name, None)
        self._loaded[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self._pending and name not in self._loaded:
            raise KeyError(name)
        self._pending.pop(name, None)
        self._loaded.pop(name, None)
        self._order.remove(name)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._loaded or name in self._pending

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, without reading it."""
        if name in self._loaded:
            return tuple(self._loaded[name].shape)
        return self._pending[name][0]

    @property
    def loaded(self) -> frozenset[str]:
        """The names read so far (tests, and the log of what a load did)."""
        return frozenset(self._loaded)


def shape_of(weights: MutableMapping, name: str) -> tuple[int, ...]:
    """A weight's shape; a lazy one's without reading it."""
    if isinstance(weights, LazyWeights):
        return weights.shape(name)
    return tuple(weights[name].shape)
