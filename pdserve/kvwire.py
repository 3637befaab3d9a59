"""Wire format of one KV cache block, as prefill writes it to the KV store and decode reads it.

A block is a contiguous tensor `[num_layers, 2, block_size, num_kv_heads, head_dim]` (index 0 of
dim 1 = keys, 1 = values) with `num_tokens <= block_size` valid token slots. On the wire it is a
fixed little-endian header followed by the tensor's raw bytes:

    magic "PDKV" | version u16 | dtype code u8 | num_layers u16 | num_kv_heads u16 | head_dim u16
    | block_size u16 | num_tokens u16 | model fingerprint 16 bytes | payload length u32
    | crc32(payload) u32 | mac 32 bytes | payload

The header carries the whole shape and the model fingerprint so a reader can refuse a block made
by another model or cache layout instead of silently attending over garbage. The crc32 catches
corruption; the mac (`pdserve.kv_mac`: HMAC-SHA256 over the block's content hash, the header
before the mac, and the payload, keyed by the cluster KV key) catches forgery: a reader holding
a key rejects a block whose mac does not verify under the hash it asked for, so neither a forged
block nor a genuine one re-labelled under another hash reaches the model. A writer without a
key writes 32 zero bytes there; a reader without a key does not check it. Version 2 added the mac.

The dtype code names the KV format: 1 float32, 2 float16, 3 bfloat16, 4 int8 and 5 fp8 (e4m3fn).
Codes 4 and 5 are scaled formats (`pdserve.runtime.kv_cache`): the block has one more row than
`block_size` (shape `[num_layers, 2, block_size + 1, num_kv_heads, head_dim]`), whose slot for
head h starts with that head's fp32 scale (little-endian); value = code * scale.
"""

from __future__ import annotations

import zlib

import torch

from pdserve import kv_mac
# The header's names (pdserve.kv_header, which the KV store imports without torch), re-exported here.
from pdserve.kv_header import (HEADER_SIZE, MAC_OFFSET, BlockHeader, KVBlockError,  # noqa: F401
                               KVChecksumError, KVFormatMismatch, KVMacError, fingerprint_bytes, pack_header,
                               read_header)
from pdserve.runtime.kv_cache import format_name
from pdserve.runtime.kv_format import KVFormat

_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.float8_e4m3fn: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


def encode_block(block: torch.Tensor, spec: KVFormat, num_tokens: int, block_hash: bytes = b"",
                 mac_key: bytes = b"") -> bytes:
    """Encode `block` (shape and dtype per `spec`) holding `num_tokens` valid slots; with `mac_key`,
    signed for the content hash `block_hash` (readers check it against the hash they asked for)."""
    if mac_key and not block_hash:
        raise KVBlockError("a signed block needs its content hash (block_hash)")
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
    header = pack_header(_DTYPE_CODES[spec.dtype], spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size,
                         num_tokens, spec.fingerprint, payload)
    mac = kv_mac.sign(mac_key, block_hash, header, payload) if mac_key else kv_mac.NO_MAC
    return header + mac + payload


def _check_header(header: BlockHeader, spec: KVFormat) -> None:
    """Raise KVBlockError naming the first header field that differs from `spec`."""
    expected_fp = fingerprint_bytes(spec.fingerprint)
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


def decode_block(data: bytes | bytearray | memoryview, spec: KVFormat, block_hash: bytes = b"",
                 mac_key: bytes = b"") -> tuple[torch.Tensor, int]:
    """Decode wire bytes into (block tensor, num_tokens), checking every header field against `spec`
    and, with `mac_key`, the MAC for the content hash `block_hash` (KVMacError when it fails).

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
        raise KVChecksumError("checksum mismatch: payload corrupted")
    if mac_key:
        _check_mac(memoryview(data)[:MAC_OFFSET], payload, header.mac, block_hash, mac_key)
    if payload.readonly:
        payload = memoryview(bytearray(payload))
    flat = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    return flat.view(spec.dtype).view(spec.shape), header.num_tokens


def _check_mac(header: memoryview, payload: memoryview, mac: bytes, block_hash: bytes, key: bytes) -> None:
    # The message names no MAC value: the expected one would be a valid MAC for forged content.
    if mac == kv_mac.NO_MAC:
        raise KVMacError("block carries no MAC (written without a KV MAC key, or forged) and this reader "
                         "requires one: give every worker the same PDSERVE_KV_MAC_KEY")
    if not block_hash or not kv_mac.verify(key, block_hash, header, payload, mac):
        raise KVMacError("MAC does not verify for this block hash: forged, altered, re-labelled, or "
                         "signed with another PDSERVE_KV_MAC_KEY")
