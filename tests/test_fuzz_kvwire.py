"""Fuzzing the KV block wire format (pdserve.kvwire) and the kvstore that carries it.

Decoding random or mutated encodings (flipped bytes, truncations, appended bytes, rewritten header
fields) either returns a block or raises KVBlockError, never anything else, and whatever it returns
has the spec's shape; a reader holding the KV MAC key returns nothing but the block that was signed. A running kvstore answers every PutBlocks of mutated blocks with OK and
counts (stored, already present or rejected), while a good block put beside them still comes back
byte for byte; afterwards the stack serves the reference output and holds no KV."""

from __future__ import annotations

import uuid

import grpc
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzz_support import FUZZ, assert_still_healthy, expected, stack_fixture  # noqa: F401 (fixture)
from pdserve.kv_header import _HEADER, HEADER_SIZE, KVBlockError
from pdserve.kvwire import decode_block, encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.v1 import kvstore_pb2

SPEC = KVFormat("ab" * 16, torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
FIELDS = ("magic", "version", "dtype_code", "num_layers", "num_kv_heads", "head_dim", "block_size",
          "num_tokens", "fingerprint", "payload_len", "crc32", "mac")
FIELD_VALUES = {"magic": st.binary(min_size=4, max_size=4), "fingerprint": st.binary(min_size=16, max_size=16),
                "mac": st.binary(min_size=32, max_size=32),
                "payload_len": st.integers(0, 2**32 - 1), "crc32": st.integers(0, 2**32 - 1)}


KEY, HASH = b"fuzz-kv-mac-key-0123456789", b"h" * 16


def good_block(seed: int, num_tokens: int, mac_key: bytes = b"") -> bytes:
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(SPEC.shape, generator=gen)
    return encode_block(tensor, SPEC, num_tokens, HASH if mac_key else b"", mac_key)


@st.composite
def mutated(draw, mac_key: bytes = b"") -> bytes:
    """A valid encoding (signed with `mac_key` when given) with one kind of damage."""
    data = bytearray(good_block(draw(st.integers(0, 3)), draw(st.integers(0, SPEC.block_size)), mac_key))
    kind = draw(st.sampled_from(["flip", "truncate", "append", "field", "random"]))
    event(kind)
    if kind == "flip":
        for i in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
            data[i] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)):]
    elif kind == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "field":
        fields = list(_HEADER.unpack_from(data, 0))
        i = draw(st.integers(0, len(FIELDS) - 1))
        fields[i] = draw(FIELD_VALUES.get(FIELDS[i], st.integers(0, 2**16 - 1) if i != 2 else st.integers(0, 255)))
        data[:HEADER_SIZE] = _HEADER.pack(*fields)
    else:
        return draw(st.binary(max_size=HEADER_SIZE + 80))
    return bytes(data)


@settings(FUZZ, max_examples=300)
@given(data=mutated(), as_type=st.sampled_from([bytes, bytearray, memoryview]))
def test_decode_raises_only_kvblockerror(data, as_type):
    try:
        block, num_tokens = decode_block(as_type(data), SPEC)
    except KVBlockError as err:
        assert str(err)
        return
    assert tuple(block.shape) == SPEC.shape and block.dtype == SPEC.dtype
    assert 0 <= num_tokens <= SPEC.block_size


@settings(FUZZ, max_examples=300)
@given(data=mutated(mac_key=KEY))
def test_keyed_reader_accepts_nothing_but_the_signed_block(data):
    try:
        block, num_tokens = decode_block(data, SPEC, block_hash=HASH, mac_key=KEY)
    except KVBlockError as err:
        event(err.reason)
        return
    # Accepted: then it must be one of the blocks that were signed, untouched (a flip may cancel out).
    assert any(data == good_block(seed, num_tokens, KEY) for seed in range(4))


def test_good_blocks_decode_to_what_was_encoded():
    tensor = torch.randn(SPEC.shape)
    block, num_tokens = decode_block(encode_block(tensor, SPEC, 3), SPEC)
    assert num_tokens == 3 and torch.equal(block, tensor)


stack = stack_fixture()


def _put(stub, blocks: list[tuple[bytes, bytes]], lease: str) -> kvstore_pb2.PutBlocksResponse:
    return stub.PutBlocks(iter([kvstore_pb2.PutBlockRequest(request_id=lease, block_hash=h, data=d)
                                for h, d in blocks]), timeout=30)


@settings(FUZZ, max_examples=60)
@given(bad=st.lists(st.tuples(st.binary(max_size=40), mutated()), min_size=1, max_size=4),
       seed=st.integers(0, 3), leased=st.booleans())
def test_kvstore_put_of_mutated_blocks(stack, bad, seed, leased):
    good_hash, good = uuid.uuid4().bytes, good_block(seed, 2)
    lease = f"fuzz-{uuid.uuid4().hex}" if leased else ""
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as channel:
        stub = stack.kvstore_stub(channel)
        try:
            response = _put(stub, [*bad, (good_hash, good)], lease)
        except grpc.RpcError as err:  # the stream as a whole may be refused, with a reason
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err
            assert err.details()
            response = _put(stub, [(good_hash, good)], lease)
        assert response.stored + response.already_present + response.rejected >= 1
        got = list(stub.GetBlocks(kvstore_pb2.GetBlocksRequest(block_hashes=[good_hash]), timeout=30))
        assert [b.data for b in got] == [good]
        if lease:
            stub.Release(kvstore_pb2.ReleaseRequest(request_id=lease, drop=True), timeout=30)


KVSTORE_METHODS = {  # method -> (request streaming, response streaming)
    "PutBlocks": (True, False), "GetBlocks": (False, True), "Lookup": (False, False),
    "Release": (False, False), "ReportResidency": (False, False)}


@settings(FUZZ, max_examples=40)
@given(method=st.sampled_from(sorted(KVSTORE_METHODS)), payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
def test_kvstore_raw_bytes_as_requests(stack, method, payloads):
    streaming_in, streaming_out = KVSTORE_METHODS[method]
    with grpc.insecure_channel(stack.child("kvstore").spec.address) as channel:
        path = f"/pdserve.v1.KVStore/{method}"
        try:
            if streaming_in:
                channel.stream_unary(path)(iter(payloads), timeout=30)
            elif streaming_out:
                list(channel.unary_stream(path)(payloads[0], timeout=30))
            else:
                channel.unary_unary(path)(payloads[0], timeout=30)
        except grpc.RpcError as err:
            event(err.code().name)
            # Bytes that parse as the message may still be refused (Release without a request id).
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err
            assert err.details()


def test_stack_healthy_after_fuzzing(stack, expected):
    assert_still_healthy(stack, expected)
