"""KV block wire format: round trips per dtype, and every kind of mismatch or corruption refused."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from pdserve.kvwire import HEADER_SIZE, MAGIC, BlockSpec, KVBlockError, decode_block, encode_block, read_header

FP = "0123456789abcdef0123456789abcdef"
SPEC = BlockSpec(fingerprint=FP, dtype=torch.float32, num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)


def _block(spec: BlockSpec) -> torch.Tensor:
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
    (4, "<H", 2, "wire version 2 != 1"),
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
