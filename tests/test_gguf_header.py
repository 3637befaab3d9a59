"""The GGUF header read by pdserve.runtime.gguf_header against gguf's own reader: every metadata
value, value type and tensor place of files with every value type, both byte orders, a custom
alignment, the models we serve; and malformed files refused, as gguf's reader refuses them."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from conftest import STORIES_GGUF, smollm2_path
from pdserve.runtime import gguf_header
from pdserve.runtime.gguf_reader import read_gguf_meta
from pdserve.runtime.loader import ModelLoadError

V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType

SCALARS = [(V.UINT8, 255), (V.INT8, -128), (V.UINT16, 65535), (V.INT16, -32768), (V.UINT32, 2**32 - 2),
           (V.INT32, -2**31), (V.FLOAT32, 1e-5), (V.BOOL, True), (V.UINT64, 2**64 - 1), (V.INT64, -2**63),
           (V.FLOAT64, 0.1), (V.STRING, "naïve ☃ <|im_end|>")]


def write_every_type(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None) -> None:
    """Every scalar type, an array of each (strings with an empty one and non-ASCII ones), and
    tensors of element and block types (gguf's writer writes no empty array)."""
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for kind, value in SCALARS:
        w.add_key_value(f"test.scalar.{kind.name.lower()}", value, kind)
        w.add_key_value(f"test.array.{kind.name.lower()}", [value, value], V.ARRAY, sub_type=kind)
    w.add_key_value("test.array.strings", ["", "a", "Ġthe", "日本語", "x" * 300], V.ARRAY, sub_type=V.STRING)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.add_tensor("scalar", np.array([2.5], dtype=np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    q41 = gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), Q.Q4_1)
    w.add_tensor("q4_1", q41, raw_dtype=Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference(path) -> gguf_header.GGUFHeader:
    return gguf_header.from_reader(gguf.GGUFReader(path))


def assert_same_header(path) -> gguf_header.GGUFHeader:
    ours, want = gguf_header.read_header(path), reference(path)
    assert list(ours.metadata) == list(want.metadata)
    for key in want.metadata:
        assert ours.metadata[key] == want.metadata[key], key
        assert type(ours.metadata[key]) is type(want.metadata[key]), key
        assert ours.value_types[key] == want.value_types[key], key
    assert ours.tensors == want.tensors
    assert (ours.data_offset, ours.swapped) == (want.data_offset, want.swapped)
    return ours


def test_every_value_type_and_tensor_type_as_ggufs_reader(tmp_path):
    path = tmp_path / "all.gguf"
    write_every_type(path)
    header = assert_same_header(path)
    assert header.metadata["test.array.strings"][3] == "日本語"
    assert [t.name for t in header.tensors] == ["f32", "f16", "i32", "scalar", "q8", "q4_1"]


def test_a_big_endian_file_and_a_custom_alignment(tmp_path):
    big = tmp_path / "big.gguf"
    write_every_type(big, gguf.GGUFEndian.BIG)
    assert assert_same_header(big).swapped
    aligned = tmp_path / "aligned.gguf"
    write_every_type(aligned, alignment=256)
    header = assert_same_header(aligned)
    assert header.metadata["general.alignment"] == 256 and header.data_offset % 256 == 0


def test_the_models_we_serve_as_ggufs_reader():
    assert_same_header(STORIES_GGUF)
    assert_same_header(smollm2_path())  # ~200k values: the reason for this module


def test_a_nested_array_is_left_to_ggufs_reader(tmp_path):
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_key_value("test.nested", [[1, 2], [3, 4]], V.ARRAY)
    w.add_tensor("f32", np.ones((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_header.NestedArray):
        gguf_header.read_header(path)
    assert gguf_header.parse(path) == reference(path)


def _two_tensors(tmp_path):
    path = tmp_path / "two.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("aa", np.ones(4, dtype=np.float32))
    w.add_tensor("bb", np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _broken(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_malformed_files_are_refused_like_ggufs_reader(tmp_path):
    good = tmp_path / "good.gguf"
    write_every_type(good)
    raw = good.read_bytes()
    header = gguf_header.read_header(good)
    header_end, last = header.data_offset, header.tensors[-1]
    cases = {
        "magic": b"GGUX" + raw[4:],
        "version": raw[:4] + struct.pack("<I", 9) + raw[8:],
        "duplicate": _two_tensors(tmp_path).read_bytes().replace(b"bb", b"aa", 1),  # the second's name, first
    }
    cases |= {f"cut-{n}": raw[:n] for n in (6, 30, header_end // 3, header_end // 2, header_end - 9,
                                                last.data_offset + last.n_bytes - 1)}
    for name, data in cases.items():
        path = _broken(tmp_path, name + ".gguf", data)
        with pytest.raises(Exception) as ggufs:
            gguf.GGUFReader(path)
        with pytest.raises(Exception) as ours:
            gguf_header.read_header(path)
        assert not isinstance(ours.value, gguf_header.NestedArray), name
        with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file"):
            read_gguf_meta(path)  # a one-line error naming the file, whatever failed inside
        assert ggufs.value is not None


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path):
    path = tmp_path / "a.gguf"
    write_every_type(path, alignment=64)
    raw = path.read_bytes()
    key = b"general.alignment"
    at = raw.index(key) + len(key) + 4  # the key, its type (uint32), its value
    assert struct.unpack_from("<I", raw, at)[0] == 64
    bad = _broken(tmp_path, "b.gguf", raw[:at] + struct.pack("<I", 48) + raw[at + 4:])
    with pytest.raises(ValueError, match="power of two"):
        gguf.GGUFReader(bad)
    with pytest.raises(ValueError, match="power of two"):
        gguf_header.read_header(bad)
