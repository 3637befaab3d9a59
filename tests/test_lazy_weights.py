"""A GGUF's weights read when first asked for (pdserve.runtime.lazy_weights): each equals gguf's own
dequantization of the file, an engine on the file's 4-bit codes never reads its projections and
generates what an engine on the eagerly read weights generates."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.gguf_reader import unpermute_rope_rows
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.lazy_weights import LazyWeights, shape_of
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from test_gguf_packed import MIXED, write_tiny

Q = gguf.GGMLQuantizationType


def ggufs_own(path, checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized by gguf itself (rows of Q/K back in HF order), by HF name."""
    spec, config, out = checkpoint.config.arch, checkpoint.config, {}
    for t in gguf.GGUFReader(path).tensors:
        name = spec.from_gguf(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(shape).float()
        heads = spec.gguf_permuted_heads(name, config)
        out[name] = unpermute_rope_rows(w, heads) if heads is not None else w
    return out


@pytest.mark.parametrize("kind", ["mixed", "stories260K"])
def test_every_weight_is_ggufs_dequantization(tmp_path, kind):
    path = STORIES_GGUF
    if kind == "mixed":
        path = tmp_path / "mixed.gguf"
        write_tiny(path, {**MIXED, "ffn_up": Q.Q4_1})  # Q4_K, Q5_K, Q6_K, Q8_0, Q4_1 and F32
    checkpoint = load_checkpoint(path)
    weights = checkpoint.weights
    assert isinstance(weights, LazyWeights)
    want = ggufs_own(path, checkpoint)
    for name, w in want.items():
        assert shape_of(weights, name) == tuple(w.shape), name
    assert weights.loaded <= {"model.embed_tokens.weight", "lm_head.weight"}  # tie_head asked for the embedding
    for name, w in want.items():
        assert torch.equal(weights[name], w), name
    assert weights.loaded == set(want) | ({"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set())


@pytest.mark.skipif(not cpu_int4_matmul.available(), reason="no C compiler: the W4A32 kernel cannot be built")
def test_an_engine_on_the_codes_reads_no_projection_and_generates_as_the_eager_load(tmp_path):
    path = tmp_path / "q4.gguf"
    write_tiny(path, {r: Q.Q4_1 for r in MIXED})
    config = EngineConfig(cache=CacheConfig(num_blocks=32), dtype="float32")
    lazy = load_checkpoint(path)
    projections = set(lazy.config.arch.projection_names(lazy.config))
    engines = {"lazy": Engine.from_checkpoint(lazy, config)}
    assert engines["lazy"].weight_format == "int4-exact"
    assert not lazy.weights.loaded & projections
    eager = load_checkpoint(path)
    eager = dataclasses.replace(eager, weights=dict(eager.weights))  # every tensor read, a plain dict
    engines["eager"] = Engine.from_checkpoint(eager, config)
    tokens = {}
    for name, e in engines.items():
        e.add_request("r", [1, 5, 9, 300, 42, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens[name] = [t for _ in iter(e.has_unfinished, False) for o in e.step() for t in o.new_token_ids]
    assert tokens["lazy"] == tokens["eager"] and len(tokens["lazy"]) == 12


def test_the_mapping_reads_once_and_keeps_its_order():
    reads = []

    def loader(name, shape):
        def load():
            reads.append(name)
            return torch.full(shape, float(len(reads)))
        return shape, load

    w = LazyWeights({"a": loader("a", (2,)), "b": loader("b", (3, 1))})
    assert list(w) == ["a", "b"] and len(w) == 2 and "b" in w and "c" not in w
    assert w.shape("b") == (3, 1) and not reads
    assert torch.equal(w["b"], torch.ones(3, 1)) and torch.equal(w["b"], torch.ones(3, 1)) and reads == ["b"]
    w["c"] = torch.zeros(1)
    w["a"] = torch.zeros(4)  # replaced before it was read: never read
    assert list(w) == ["a", "b", "c"] and reads == ["b"] and w.shape("a") == (4,)
    del w["b"]
    assert list(w) == ["a", "c"] and "b" not in w
    with pytest.raises(KeyError):
        w["b"]
    with pytest.raises(KeyError):
        del w["zz"]
    assert set(dict(w)) == {"a", "c"} and w.loaded == {"a", "c"}
