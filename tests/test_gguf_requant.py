"""A GGUF's projections re-encoded in another block type (pdserve.quant.gguf_requant): the codes are
what gguf's own quantizer makes of the source's values, everything else is copied byte for byte, the
file loads and serves packed, and bad requests fail in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pdserve.quant.gguf_requant import RequantError, is_projection, requantize_gguf
from pdserve.runtime.loader import load_checkpoint
from test_gguf_packed import engine, greedy_with_logits, write_tiny

Q = gguf.GGMLQuantizationType
SOURCE_TYPES = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1,
                "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("requant")
    write_tiny(d / "src.gguf", SOURCE_TYPES)
    requantize_gguf(d / "src.gguf", d / "q8.gguf", "q8_0")
    return gguf.GGUFReader(d / "src.gguf"), gguf.GGUFReader(d / "q8.gguf"), d


def test_projections_are_gguf_quantize_of_the_source_values(files):
    src, dst, _ = files
    by_name = {t.name: t for t in dst.tensors}
    projections = [t for t in src.tensors if is_projection(t.name)]
    assert len(projections) == 2 * len(SOURCE_TYPES)
    for t in projections:
        got = by_name[t.name]
        assert got.tensor_type == Q.Q8_0
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        assert np.array_equal(np.asarray(got.data), quantize(values, Q.Q8_0)), t.name
        assert list(got.shape) == list(t.shape)


def test_other_tensors_and_metadata_are_copied(files):
    src, dst, _ = files
    by_name = {t.name: t for t in dst.tensors}
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    for t in src.tensors:
        if not is_projection(t.name):
            assert by_name[t.name].tensor_type == t.tensor_type
            assert np.array_equal(np.asarray(by_name[t.name].data), np.asarray(t.data)), t.name
    keys = lambda r: {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}  # noqa: E731
    assert keys(dst) == keys(src)


def test_requantized_file_serves_packed_as_its_dense_load(files):
    """The Q8_0 file through the packed kernel (two 4-bit planes) against the same file dequantized."""
    *_, d = files
    checkpoint = load_checkpoint(d / "q8.gguf", dtype=torch.bfloat16)
    packed, dense = engine(checkpoint, "packed"), engine(checkpoint, "dense")
    assert packed.weight_format == "packed"
    prompt = [3, 17, 99, 4, 250, 31]
    tokens_p, logits_p = greedy_with_logits(packed, prompt, 6)
    tokens_d, logits_d = greedy_with_logits(dense, prompt, 6)
    assert tokens_p == tokens_d
    scale = max(x.abs().max().item() for x in logits_d)
    assert max((a - b).abs().max().item() for a, b in zip(logits_p, logits_d)) <= 0.05 * scale


def test_unknown_type_and_a_file_without_projections_fail_in_one_line(files, tmp_path):
    *_, d = files
    with pytest.raises(RequantError, match="unknown GGUF type 'Q9_9'"):
        requantize_gguf(d / "src.gguf", tmp_path / "x.gguf", "Q9_9")
    w = gguf.GGUFWriter(tmp_path / "empty.gguf", "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RequantError, match="no llama-block projection tensors"):
        requantize_gguf(tmp_path / "empty.gguf", tmp_path / "y.gguf", "Q8_0")
