"""Wire format of one KV cache block, as prefill writes it to the KV store and decode reads it.

A block is a contiguous tensor `[num_layers, 2, block_size, num_kv_heads, head_dim]` (index 0 of
dim 1 = keys, 1 = values) with `num_tokens <= block_size` valid token slots. On the wire it is a
fixed little-endian header followed by the tensor's raw bytes:

    magic "PDKV" | version u16 | dtype code u8 | num_layers u16 | num_kv_heads u16 | head_dim u16
    | block_size u16 | num_tokens u16 | model fingerprint 16 bytes | payload length u32
    | crc32(payload) u32 | payload

The header carries the whole shape and the model fingerprint so a reader can refuse a block made
by another model or cache layout instead of silently attending over garbage.

The dtype code names the KV format: 1 float32, 2 float16, 3 bfloat16, 4 int8 and 5 fp8 (e4m3fn).
Codes 4 and 5 are scaled formats (`pdserve.runtime.kv_cache`): the block has one more row than
`block_size` (shape `[num_layers, 2, block_size + 1, num_kv_heads, head_dim]`), whose slot for
head h starts with that head's fp32 scale (little-endian); value = code * scale.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from pdserve.runtime.kv_cache import cache_rows, format_name

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sHBHHHHH16sII")
HEADER_SIZE = _HEADER.size

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.float8_e4m3fn: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class KVBlockError(ValueError):
    """Encoded block data does not match what the reader expects, or is corrupt."""


class KVFormatMismatch(KVBlockError):
    """A well-formed block in another KV format (--kv-dtype) than the reader's."""


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """What a reader expects of a block: the model that made it and the cache layout."""

    fingerprint: str  # 32 hex chars identifying the model weights and config
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """[layers, 2, rows, KVH, D]: rows = block_size, + 1 scale row for int8 / fp8."""
        return (self.num_layers, 2, cache_rows(self.block_size, self.dtype), self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header of one block."""

    version: int
    dtype_code: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    fingerprint: bytes
    payload_len: int
    crc32: int


def _fingerprint_bytes(fingerprint: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raise KVBlockError(f"model fingerprint {fingerprint!r} is not hex") from None
    if len(raw) != 16:
        raise KVBlockError(f"model fingerprint {fingerprint!r} is not 32 hex chars")
    return raw


def encode_block(block: torch.Tensor, spec: BlockSpec, num_tokens: int) -> bytes:
    """Encode `block` (shape and dtype per `spec`) holding `num_tokens` valid slots."""
    if tuple(block.shape) != spec.shape:
        raise KVBlockError(f"block shape {tuple(block.shape)} != expected {spec.shape}")
    if block.dtype != spec.dtype:
        raise KVBlockError(f"block dtype {block.dtype} != expected {spec.dtype}")
    if spec.dtype not in _DTYPE_CODES:
        raise KVBlockError(f"unsupported dtype {spec.dtype}")
    if not 0 <= num_tokens <= spec.block_size:
        raise KVBlockError(f"num_tokens {num_tokens} outside 0..{spec.block_size}")
    # view(uint8) reinterprets the bytes, so bfloat16 (which numpy lacks) works too.
    payload = block.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    header = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[spec.dtype], spec.num_layers,
                          spec.num_kv_heads, spec.head_dim, spec.block_size, num_tokens,
                          _fingerprint_bytes(spec.fingerprint), len(payload), zlib.crc32(payload))
    return header + payload


def read_header(data: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and sanity-check the header only (magic, version); no spec needed.

    The KV store uses this to refuse garbage without decoding the payload.
    """
    if len(data) < HEADER_SIZE:
        raise KVBlockError(f"block data is {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, *fields = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise KVBlockError(f"bad magic {magic!r} != {MAGIC!r}")
    if version != VERSION:
        raise KVBlockError(f"wire version {version} != {VERSION}")
    return BlockHeader(version, *fields)


def _check_header(header: BlockHeader, spec: BlockSpec) -> None:
    """Raise KVBlockError naming the first header field that differs from `spec`."""
    expected_fp = _fingerprint_bytes(spec.fingerprint)
    if header.fingerprint != expected_fp:
        raise KVBlockError(f"model fingerprint {header.fingerprint.hex()} != {expected_fp.hex()}")
    dtype = _CODE_DTYPES.get(header.dtype_code)
    if dtype is None:
        raise KVBlockError(f"unknown KV dtype code {header.dtype_code}")
    if dtype != spec.dtype:
        raise KVFormatMismatch(f"KV format {format_name(dtype)} != {format_name(spec.dtype)}: the block was "
                               f"made with --kv-dtype {format_name(dtype)}, this worker runs "
                               f"--kv-dtype {format_name(spec.dtype)}")
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
        got, want = getattr(header, name), getattr(spec, name)
        if got != want:
            raise KVBlockError(f"{name} {got} != {want}")
    if header.num_tokens > spec.block_size:
        raise KVBlockError(f"num_tokens {header.num_tokens} > block_size {spec.block_size}")
    if header.payload_len != spec.payload_bytes:
        raise KVBlockError(f"payload length {header.payload_len} != {spec.payload_bytes}")


def decode_block(data: bytes | bytearray | memoryview, spec: BlockSpec) -> tuple[torch.Tensor, int]:
    """Decode wire bytes into (block tensor, num_tokens), checking every header field against `spec`.

    The tensor shares memory with `data` when `data` is writable (bytearray, writable memoryview);
    for immutable `bytes` the payload is copied once, since torch tensors must be writable.
    """
    header = read_header(data)
    _check_header(header, spec)
    actual = len(data) - HEADER_SIZE
    if actual != header.payload_len:
        raise KVBlockError(f"payload is {actual} bytes, header says {header.payload_len} (truncated?)")
    payload = memoryview(data)[HEADER_SIZE:]
    if zlib.crc32(payload) != header.crc32:
        raise KVBlockError("checksum mismatch: payload corrupted")
    if payload.readonly:
        payload = memoryview(bytearray(payload))
    flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    return flat.view(spec.dtype).view(spec.shape), header.num_tokens
