"""Where a GGUF file's tensors lie, read once per file a process loads.

Why: an engine's load asks a file for its tensors three times (the weights, the projections' packed
codes, the head's type), and a header parse was 2.75 s with gguf's reader (SmolLM2, 2-core Zen 3
EPYC; `runtime.gguf_header` reads it in 0.06-0.14 s now): building a SmolLM2 engine from its loaded
checkpoint took 6.5 s there, 0.6 s with the table kept. The table keeps each tensor's place, not
the file: `tensors` maps the file again for its caller (a mapping costs nothing until read), so no
page of the file stays mapped once the caller drops the arrays. A table is taken only while the
file's size and its header's bytes (metadata and tensor infos, everything the table comes from: 1.8
MB for SmolLM2, hashed in about 3 ms) are those it was read from; else the file is parsed again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import ReaderTensor

from pdserve.runtime.gguf_header import GGUFHeader, TensorPlace, parse

_KEPT_FILES = 4  # tables kept (a process loads one model; tests load a few)


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


def remember(path: Path, header: GGUFHeader) -> tuple[TensorPlace, ...]:
    """Keep (and return) the table of the file whose header has just been parsed."""
    table = _Table(os.path.getsize(path), _digest(path, header.data_offset), header.data_offset, header.tensors)
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
    """The file's tensor table: kept, or parsed now (the parse's errors propagate: callers name the file)."""
    kept = _kept(path)
    return kept if kept is not None else remember(path, parse(path))


def tensors(path: Path) -> list[ReaderTensor]:
    """The file's tensors as `GGUFReader.tensors` lists them (their `field` None), the data views of
    one fresh read-only mapping."""
    return views(path, places(path))


def views(path: Path, table: tuple[TensorPlace, ...]) -> list[ReaderTensor]:
    """The tensors of `table` (the file's, just parsed) over one fresh read-only mapping of it."""
    data = np.memmap(path, mode="r")
    return [ReaderTensor(name=p.name, tensor_type=p.tensor_type, shape=np.array(p.shape, dtype=np.uint64),
                         n_elements=p.n_elements, n_bytes=p.n_bytes, data_offset=p.data_offset,
                         data=data[p.data_offset:p.data_offset + p.n_bytes].view(p.data_dtype).reshape(p.data_shape),
                         field=None)
            for p in table]
