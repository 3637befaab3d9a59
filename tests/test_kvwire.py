"""KV block wire format: round trips per dtype, and every kind of mismatch, corruption or forgery
(a block whose MAC does not verify for its hash under the reader's key) refused."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest
import torch

from pdserve.kv_header import HEADER_SIZE, MAGIC, KVBlockError, KVMacError, read_header
from pdserve.kvwire import decode_block, encode_block
from pdserve.runtime.kv_format import KVFormat

FP = "0123456789abcdef0123456789abcdef"
SPEC = KVFormat(fingerprint=FP, dtype=torch.float32, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


def _block(spec: KVFormat) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if spec.dtype == torch.int8:
        return torch.randint(-128, 128, spec.shape, dtype=torch.int8, generator=gen)
    return torch.randn(spec.shape, generator=gen).to(spec.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_round_trip(dtype: torch.dtype, wrap: type) -> None:
    spec = dataclasses.replace(SPEC, dtype=dtype)
    block = _block(spec)
    data = encode_block(block, spec, num_tokens=3)
    assert len(data) == HEADER_SIZE + block.numel() * block.element_size()
    decoded, num_tokens = decode_block(wrap(data), spec)
    assert num_tokens == 3
    assert decoded.dtype == dtype and tuple(decoded.shape) == spec.shape
    assert torch.equal(decoded, block)


def test_decode_shares_memory_with_bytearray() -> None:
    buf = bytearray(encode_block(_block(SPEC), SPEC, 4))
    decoded, _ = decode_block(buf, SPEC)
    decoded[0, 0, 0, 0, 0] = 42.0  # a write through the tensor shows up in the buffer: no copy
    assert struct.unpack_from("<f", buf, HEADER_SIZE)[0] == 42.0


def test_non_contiguous_block_encodes_like_contiguous() -> None:
    block = _block(SPEC)
    strided = block.transpose(0, 4).contiguous().transpose(0, 4)  # same values, other layout
    assert not strided.is_contiguous()
    assert encode_block(strided, SPEC, 4) == encode_block(block, SPEC, 4)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("fingerprint", "f" * 32, "model fingerprint 0123456789abcdef0123456789abcdef != ffff"),
    ("dtype", torch.float16, "KV format float32 != float16"),
    ("num_layers", 4, "num_layers 3 != 4"),
    ("num_kv_heads", 1, "num_kv_heads 2 != 1"),
    ("head_dim", 16, "head_dim 8 != 16"),
    ("block_size", 8, "block_size 4 != 8"),
])
def test_header_mismatch_rejected(field: str, value: object, message: str) -> None:
    data = encode_block(_block(SPEC), SPEC, 2)
    with pytest.raises(KVBlockError, match=message):
        decode_block(data, dataclasses.replace(SPEC, **{field: value}))


def _patch_header(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(("offset", "fmt", "value", "message"), [
    (0, "<4s", b"XXXX", "bad magic"),
    (4, "<H", 1, "wire version 1 != 2"),
    (6, "<B", 99, "unknown KV dtype code 99"),
    (15, "<H", 5, "num_tokens 5 > block_size 4"),
    (33, "<I", 12, "payload length 12 != "),
])
def test_corrupt_header_rejected(offset: int, fmt: str, value: int | bytes, message: str) -> None:
    data = _patch_header(encode_block(_block(SPEC), SPEC, 2), offset, fmt, value)
    with pytest.raises(KVBlockError, match=message):
        decode_block(data, SPEC)


def test_flipped_payload_byte_rejected_by_checksum() -> None:
    buf = bytearray(encode_block(_block(SPEC), SPEC, 2))
    buf[HEADER_SIZE + 17] ^= 0x01
    with pytest.raises(KVBlockError, match="checksum mismatch"):
        decode_block(buf, SPEC)


@pytest.mark.parametrize("keep", [0, 3, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 10, -1])
def test_truncated_data_rejected(keep: int) -> None:
    data = encode_block(_block(SPEC), SPEC, 2)
    with pytest.raises(KVBlockError):
        decode_block(data[:keep], SPEC)


def test_trailing_bytes_rejected() -> None:
    data = encode_block(_block(SPEC), SPEC, 2)
    with pytest.raises(KVBlockError, match="truncated"):
        decode_block(data + b"\0", SPEC)


def test_read_header_fields() -> None:
    header = read_header(encode_block(_block(SPEC), SPEC, 3))
    assert (header.num_layers, header.num_kv_heads, header.head_dim, header.block_size, header.num_tokens) \
        == (3, 2, 8, 4, 3)
    assert header.fingerprint.hex() == FP and MAGIC == b"PDKV"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_tokens": 5}, "num_tokens 5 outside"),
    ({"block": torch.zeros(3, 2, 4, 2, 4)}, "block shape"),
    ({"block": torch.zeros(SPEC.shape, dtype=torch.float16)}, "block dtype"),
    ({"spec": dataclasses.replace(SPEC, fingerprint="abcd")}, "not 32 hex chars"),
    ({"spec": dataclasses.replace(SPEC, fingerprint="zz" * 16)}, "not hex"),
])
def test_encode_rejects_bad_input(kwargs: dict, message: str) -> None:
    args = {"block": _block(SPEC), "spec": SPEC, "num_tokens": 2, **kwargs}
    with pytest.raises(KVBlockError, match=message):
        encode_block(**args)


KEY = b"k" * 32
HASH = bytes(range(16))


def _signed(num_tokens: int = 2) -> bytes:
    return encode_block(_block(SPEC), SPEC, num_tokens, block_hash=HASH, mac_key=KEY)


def test_signed_block_round_trips_and_unkeyed_readers_still_read_it() -> None:
    data = _signed()
    decoded, num_tokens = decode_block(data, SPEC, block_hash=HASH, mac_key=KEY)
    assert num_tokens == 2 and torch.equal(decoded, _block(SPEC))
    assert torch.equal(decode_block(data, SPEC)[0], decoded)  # a reader without a key ignores the MAC
    assert read_header(data).mac != bytes(32)


@pytest.mark.parametrize(("offset", "reason"), [
    (4, "invalid"), (8, "invalid"), (20, "invalid"), (33, "invalid"),  # version, shape, fingerprint, length
    (15, "mac"),  # num_tokens 2 -> 3: a valid header, only the MAC can tell
    (37, "checksum"), (HEADER_SIZE - 1, "mac"),  # the crc32; the MAC itself
    (HEADER_SIZE, "mac"), (HEADER_SIZE + 17, "mac"), (-1, "mac"),  # payload, crc32 fixed up as a forger would
])
def test_one_tampered_byte_is_refused(offset: int, reason: str) -> None:
    buf = bytearray(_signed())
    buf[offset] ^= 0x01
    if offset >= HEADER_SIZE or offset == -1:
        struct.pack_into("<I", buf, 37, zlib.crc32(buf[HEADER_SIZE:]))
    with pytest.raises(KVBlockError) as err:
        decode_block(bytes(buf), SPEC, block_hash=HASH, mac_key=KEY)
    assert err.value.reason == reason, err.value


def test_payload_forged_with_a_valid_crc_is_refused_for_the_mac() -> None:
    buf = bytearray(_signed())
    buf[HEADER_SIZE + 5] ^= 0x80
    struct.pack_into("<I", buf, 37, zlib.crc32(buf[HEADER_SIZE:]))
    with pytest.raises(KVMacError, match="MAC does not verify") as err:
        decode_block(buf, SPEC, block_hash=HASH, mac_key=KEY)
    assert err.value.reason == "mac"
    assert KEY.decode() not in str(err.value)


def test_genuine_block_relabelled_under_another_hash_is_refused() -> None:
    other = bytes(reversed(HASH))
    with pytest.raises(KVMacError):
        decode_block(_signed(), SPEC, block_hash=other, mac_key=KEY)


@pytest.mark.parametrize("data", [
    pytest.param(lambda: encode_block(_block(SPEC), SPEC, 2), id="unsigned"),
    pytest.param(lambda: encode_block(_block(SPEC), SPEC, 2, block_hash=HASH, mac_key=b"x" * 32), id="other-key"),
])
def test_unsigned_or_foreign_blocks_are_refused_by_a_keyed_reader(data) -> None:
    with pytest.raises(KVMacError):
        decode_block(data(), SPEC, block_hash=HASH, mac_key=KEY)


def test_signing_needs_the_hash() -> None:
    with pytest.raises(KVBlockError, match="block_hash"):
        encode_block(_block(SPEC), SPEC, 2, mac_key=KEY)


def test_every_kv_format_has_one_name_one_storage_dtype_and_one_wire_code():
    """The --kv-dtype names (torch-free, for flag parsing), the cache's storage dtypes and the wire
    codes are three tables; they must cover the same formats."""
    from pdserve.kvwire import _DTYPE_CODES
    from pdserve.runtime.config import KV_DTYPE_NAMES
    from pdserve.runtime.kv_cache import KV_DTYPES

    assert tuple(KV_DTYPES) == KV_DTYPE_NAMES
    assert set(_DTYPE_CODES) == set(KV_DTYPES.values())
    for name in KV_DTYPE_NAMES:
        fmt = KVFormat.named(FP, name, 1, 1, 4, 4)
        assert fmt.kv_dtype == name and fmt.with_kv_dtype("float32").kv_dtype == "float32"
