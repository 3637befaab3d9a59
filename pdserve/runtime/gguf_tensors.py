"""Where a GGUF file's tensors lie, read once per file a process loads.

Why: gguf's `GGUFReader` turns every metadata value into numpy views before it lists a single
tensor (SmolLM2's vocabulary, token types and merges: ~200k values, 2.7 s on a 2-core Zen 3 EPYC),
and an engine's load asked a file for its tensors three times (the weights, the projections' packed
codes, the head's type): building a SmolLM2 engine from its loaded checkpoint took 6.5 s there, 0.6
s now. The table keeps each tensor's place, not the file: `tensors` maps the file again for its
caller (a mapping costs nothing until read), so no page of the file stays mapped once the caller
drops the arrays. A table is taken only while the file's size and its header's bytes (metadata and
tensor infos, everything the table comes from: 1.8 MB for SmolLM2, hashed in about 3 ms) are those
it was read from; else the file is parsed again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

_KEPT_FILES = 4  # tables kept (a process loads one model; tests load a few)


@dataclass(frozen=True, slots=True)
class TensorPlace:
    """A tensor as `GGUFReader` lists it, less its data: where the data lies and how to view it."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, fastest dimension first (ReaderTensor.shape)
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data_dtype: np.dtype  # the reader's view: the element type, or uint8 bytes for block types
    data_shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Table:
    size: int  # the file's bytes
    header_digest: bytes  # of its bytes before the tensor data
    header_bytes: int
    places: tuple[TensorPlace, ...]


_tables: OrderedDict[str, _Table] = OrderedDict()  # by resolved path, least recently used first
_lock = threading.Lock()


def _digest(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(n), digest_size=16).digest()


def _place(t: ReaderTensor) -> TensorPlace:
    return TensorPlace(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes),
                       int(t.data_offset), t.data.dtype, tuple(t.data.shape))


def remember(path: Path, reader: GGUFReader) -> tuple[TensorPlace, ...]:
    """Keep (and return) the table of the file that `reader` has just parsed."""
    table = _Table(os.path.getsize(path), _digest(path, reader.data_offset), reader.data_offset,
                   tuple(_place(t) for t in reader.tensors))
    key = str(Path(path).resolve())
    with _lock:
        _tables[key] = table
        _tables.move_to_end(key)
        while len(_tables) > _KEPT_FILES:
            _tables.popitem(last=False)
    return table.places


def _kept(path: Path) -> tuple[TensorPlace, ...] | None:
    with _lock:
        table = _tables.get(str(Path(path).resolve()))
    if table is None or os.path.getsize(path) != table.size:
        return None
    return table.places if _digest(path, table.header_bytes) == table.header_digest else None


def places(path: Path) -> tuple[TensorPlace, ...]:
    """The file's tensor table: kept, or parsed now (gguf's errors propagate: callers name the file)."""
    kept = _kept(path)
    return kept if kept is not None else remember(path, GGUFReader(path))


def tensors(path: Path) -> list[ReaderTensor]:
    """The file's tensors as `GGUFReader.tensors` lists them (their `field` None), the data views of
    one fresh read-only mapping."""
    data = np.memmap(path, mode="r")
    return [ReaderTensor(name=p.name, tensor_type=p.tensor_type, shape=np.array(p.shape, dtype=np.uint64),
                         n_elements=p.n_elements, n_bytes=p.n_bytes, data_offset=p.data_offset,
                         data=data[p.data_offset:p.data_offset + p.n_bytes].view(p.data_dtype).reshape(p.data_shape),
                         field=None)
            for p in places(path)]
