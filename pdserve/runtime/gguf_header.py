"""A GGUF file's header (metadata and tensor infos), read in one pass over its bytes.

Why hand-written: gguf's `GGUFReader` builds numpy views for every value before it lists a tensor
(SmolLM2's vocabulary, token types and merges: ~200k values, 2.75 s a parse on a 2-core Zen 3 EPYC),
and every process of a stack parses the model's file: the gateway (its tokenizer), each prefill and
decode worker. This reads the same format (GGUF v2 and v3, either byte order, `general.alignment`)
with `struct` and one numpy read per numeric array: 0.06-0.14 s for SmolLM2. The format's constants
(value types, tensor types and their block sizes) are gguf's, and gguf's reader stays the reference:
tests/test_gguf_header.py compares every value and tensor place with it. A nested array (an array
of arrays, which no model file of ours holds) is left to gguf's reader (`NestedArray`).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_V = GGUFValueType
_SCALARS: dict[GGUFValueType, str] = {  # struct codes, without the byte order
    _V.UINT8: "B", _V.INT8: "b", _V.UINT16: "H", _V.INT16: "h", _V.UINT32: "I", _V.INT32: "i",
    _V.FLOAT32: "f", _V.BOOL: "?", _V.UINT64: "Q", _V.INT64: "q", _V.FLOAT64: "d",
}
_NUMPY: dict[GGUFValueType, str] = {
    _V.UINT8: "u1", _V.INT8: "i1", _V.UINT16: "u2", _V.INT16: "i2", _V.UINT32: "u4", _V.INT32: "i4",
    _V.FLOAT32: "f4", _V.BOOL: "?", _V.UINT64: "u8", _V.INT64: "i8", _V.FLOAT64: "f8",
}
_T = GGMLQuantizationType
# Element types whose data the reader views as numbers; any other type's data is bytes.
_ITEM_TYPES = {_T.F16: "f2", _T.F32: "f4", _T.F64: "f8", _T.I8: "i1", _T.I16: "i2", _T.I32: "i4", _T.I64: "i8"}


class NestedArray(ValueError):
    """The file holds an array of arrays: gguf's reader flattens it; we leave it to that reader."""


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
class GGUFHeader:
    metadata: dict[str, Any]  # key -> value as gguf's `ReaderField.contents()` gives it
    value_types: dict[str, tuple[GGUFValueType, ...]]  # key -> (type,) or (ARRAY, element type)
    tensors: tuple[TensorPlace, ...]  # in the file's order
    data_offset: int  # where the tensor data starts (aligned)
    swapped: bool  # the file's byte order is not this host's


class _Cursor:
    """Reads values in order from the file's bytes; `order` is struct's byte-order character."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0
        self._length = struct.Struct(order + "Q")  # a string's length: ~100k reads in SmolLM2's header

    def scalar(self, code: str) -> Any:
        fmt = self.order + code
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = self._length.unpack_from(self.buf, self.pos)
        self.pos += 8
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
        value = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return value

    def array(self, kind: GGUFValueType, count: int) -> list[Any]:
        if kind == _V.STRING:
            return [self.string() for _ in range(count)]
        if kind == _V.ARRAY:
            raise NestedArray("an array of arrays")
        dtype = np.dtype(_NUMPY[kind]).newbyteorder(self.order)
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
            raise ValueError(f"an array of {count} values at offset {self.pos} runs past the end of the file")
        values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
        self.pos = end
        return values


def parse(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path` (gguf's reader's, for a file with nested arrays);
    ValueError (or struct.error, UnicodeDecodeError, ...) on a malformed or truncated one."""
    try:
        return read_header(path)
    except NestedArray:
        return from_reader(GGUFReader(path))


def from_reader(reader: GGUFReader) -> GGUFHeader:
    """The header gguf's reader has parsed (the reference of tests/test_gguf_header.py)."""
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # version and counts
    return GGUFHeader({k: f.contents() for k, f in fields.items()}, {k: tuple(f.types) for k, f in fields.items()},
                      tuple(_place(t) for t in reader.tensors), reader.data_offset, reader.byte_order == "S")


def _place(t: Any) -> TensorPlace:
    return TensorPlace(t.name, t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes),
                       int(t.data_offset), t.data.dtype, tuple(t.data.shape))


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path`, read here; NestedArray for a file this does not read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:  # as gguf's reader: written for the other byte order
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version}, not one of {', '.join(map(str, READER_SUPPORTED_VERSIONS))}")
        cur = _Cursor(buf, order)
        cur.pos = 8
        tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
        metadata, value_types = _read_metadata(cur, kv_count)
        infos = [_read_tensor_info(cur) for _ in range(tensor_count)]
        alignment = _alignment(metadata, value_types)
        data_offset = -(-cur.pos // alignment) * alignment
        places = _places(infos, data_offset, order)
        for p in places:  # gguf's reader fails on the view of such a tensor: so does this
            if p.data_offset + p.n_bytes > len(buf):
                raise ValueError(f"tensor {p.name}'s {p.n_bytes} bytes at offset {p.data_offset} run past the "
                                 f"end of the file ({len(buf)} bytes)")
        return GGUFHeader(metadata, value_types, places, data_offset, order == ">")


def _read_metadata(cur: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, tuple[GGUFValueType, ...]]]:
    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[GGUFValueType, ...]] = {}
    for _ in range(count):
        key = cur.string()
        kind = _V(cur.scalar("I"))
        if kind == _V.STRING:
            metadata[key], value_types[key] = cur.string(), (kind,)
        elif kind == _V.ARRAY:
            element = _V(cur.scalar("I"))
            metadata[key], value_types[key] = cur.array(element, cur.scalar("Q")), (kind, element)
        else:
            metadata[key], value_types[key] = cur.scalar(_SCALARS[kind]), (kind,)
    return metadata, value_types


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, dims fastest first, raw GGML type, offset in the data section)."""
    name = cur.string()
    n_dims = cur.scalar("I")
    dims = tuple(cur.scalar("Q") for _ in range(n_dims))
    return name, dims, cur.scalar("I"), cur.scalar("Q")


def _alignment(metadata: dict[str, Any], value_types: dict[str, tuple[GGUFValueType, ...]]) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    if value_types["general.alignment"] != (_V.UINT32,):
        raise ValueError("Bad type for general.alignment field")
    alignment = metadata["general.alignment"]
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError("Invalid alignment: must be a non-zero power of two")
    return alignment


def _places(infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int, order: str
            ) -> tuple[TensorPlace, ...]:
    places, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"Found duplicated tensor with name {name}")
        seen.add(name)
        kind = GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims, dtype=np.uint64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        shape = tuple(reversed(dims))  # numpy's order, slowest first
        if kind in _ITEM_TYPES:
            dtype = np.dtype(_ITEM_TYPES[kind]).newbyteorder(order)
        else:
            dtype, shape = np.dtype(np.uint8), tuple(quant_shape_to_byte_shape(shape, kind))
        places.append(TensorPlace(name, kind, dims, n_elements, n_bytes, data_offset + offset, dtype, shape))
    return tuple(places)
