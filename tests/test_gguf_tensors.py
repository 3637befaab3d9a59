"""A GGUF file's tensor table read once per file (pdserve.runtime.gguf_tensors): the tensors it hands
out against gguf's own reader, a file changed in place read again, and an engine's whole load
parsing its file once (it parsed it three times: building a SmolLM2 engine took 6.5 s, now 0.6)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from conftest import STORIES_GGUF
from pdserve.runtime import gguf_header, gguf_tensors
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.loader import load_checkpoint
from test_gguf_packed import MIXED, _patch_tensor_info, write_tiny

Q = gguf.GGMLQuantizationType


def _assert_same_tensors(path) -> None:
    want = gguf.GGUFReader(path).tensors
    got = gguf_tensors.tensors(path)
    assert [t.name for t in got] == [t.name for t in want]
    for a, b in zip(got, want):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == \
               (b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_tensors_are_the_readers_for_float_and_block_types(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_tiny(path, {**MIXED, "ffn_up": Q.Q4_1})  # F32 norms and embedding, Q4_K, Q5_K, Q6_K, Q8_0, Q4_1
    _assert_same_tensors(path)
    _assert_same_tensors(path)  # from the kept table
    _assert_same_tensors(STORIES_GGUF)


def test_a_file_changed_in_place_is_read_again(tmp_path):
    """Same size, rewritten at once: the header's bytes, not the file's times, decide."""
    path = tmp_path / "m.gguf"
    write_tiny(path, {r: Q.Q8_0 for r in MIXED})
    assert "blk.1.ffn_down.weight" in {p.name for p in gguf_tensors.places(path)}
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"blk.1.ffn_down.weight", b"blk.1.ffn_dowX.weight"))
    assert "blk.1.ffn_dowX.weight" in {p.name for p in gguf_tensors.places(path)}
    _patch_tensor_info(path, b"blk.1.ffn_dowX.weight", dim0=256)  # a dimension only: 512 -> 256 columns
    assert next(p for p in gguf_tensors.places(path) if p.name == "blk.1.ffn_dowX.weight").shape == (256, 256)
    _assert_same_tensors(path)


@pytest.mark.skipif(not cpu_int4_matmul.available(), reason="no C compiler: the W4A32 kernel cannot be built")
def test_an_engine_load_parses_its_file_once(tmp_path, monkeypatch):
    """load_checkpoint, then an int4-exact engine (the file's Q4_1 codes read again, the head's type
    asked): one header parse in all, and none by gguf's slow reader (runtime.gguf_header)."""
    path = tmp_path / "q4.gguf"
    write_tiny(path, {r: Q.Q4_1 for r in MIXED})
    parses, slow = [], []
    read, init = gguf_header.read_header, gguf.GGUFReader.__init__

    def counted(p):
        parses.append(p)
        return read(p)

    def counted_slow(self, *args, **kwargs):
        slow.append(args[0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(gguf_header, "read_header", counted)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted_slow)
    checkpoint = load_checkpoint(path)
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=16), dtype="float32"))
    assert engine.weight_format == "int4-exact"
    assert len(parses) == 1 and not slow, (parses, slow)
