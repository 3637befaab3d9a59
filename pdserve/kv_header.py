"""The fixed header of a KV block on the wire (`pdserve.kvwire` says what it holds), without torch.

Why a module of its own: the KV store checks every block's header and never decodes a payload, so
it imports this alone and not torch (about 1.4 s of its start and 190 MB of its memory); the workers' tensors are
`pdserve.kvwire`'s.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from pdserve import kv_mac

MAGIC = b"PDKV"
VERSION = 2
_HEADER = struct.Struct(f"<4sHBHHHHH16sII{kv_mac.MAC_SIZE}s")
HEADER_SIZE = _HEADER.size
MAC_OFFSET = HEADER_SIZE - kv_mac.MAC_SIZE  # the mac covers the header up to here


class KVBlockError(ValueError):
    """Encoded block data does not match what the reader expects, or is corrupt."""

    reason = "invalid"  # the `reason` label of pdserve_kv_blocks_rejected_total


class KVFormatMismatch(KVBlockError):
    """A well-formed block in another KV format (--kv-dtype) than the reader's."""

    reason = "format"


class KVChecksumError(KVBlockError):
    """The payload does not match the header's crc32: corrupted on the way or at rest."""

    reason = "checksum"


class KVMacError(KVBlockError):
    """The block's MAC does not verify under the reader's key and the hash it asked for: forged,
    altered, re-labelled under another hash, or written without (or with another) key."""

    reason = "mac"


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
    mac: bytes


def fingerprint_bytes(fingerprint: str) -> bytes:
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raise KVBlockError(f"model fingerprint {fingerprint!r} is not hex") from None
    if len(raw) != 16:
        raise KVBlockError(f"model fingerprint {fingerprint!r} is not 32 hex chars")
    return raw


def pack_header(dtype_code: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                num_tokens: int, fingerprint: str, payload: bytes) -> bytes:
    """The header's bytes up to the mac (MAC_OFFSET of them): what the mac signs, before it."""
    return _HEADER.pack(MAGIC, VERSION, dtype_code, num_layers, num_kv_heads, head_dim, block_size, num_tokens,
                        fingerprint_bytes(fingerprint), len(payload), zlib.crc32(payload), kv_mac.NO_MAC)[:MAC_OFFSET]


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
