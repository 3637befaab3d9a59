"""The architecture spec and the one decoder layer: the spec's names and shapes are what the loaders
produce (and what transformers holds), and the calibration forward of a layer equals the serving
model's paged forward of it (and transformers' hidden states)."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from conftest import STORIES_GGUF, model_config_from_hf, random_hf_model
from pdserve.quant.checkpoint import write_gguf_tokenizer
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.layerwise import quantize_model
from pdserve.quant.spec import QuantSpec
from pdserve.runtime.arch import ARCH_SPECS
from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.config import CacheConfig, ModelConfig
from pdserve.runtime.kernels import torch_ops
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.model import LlamaModel, build_layer, dense_forward, layer_context

BLOCK = 16


def _shapes(weights: dict) -> dict[str, tuple[int, ...]]:
    return {name: tuple(w.shape) for name, w in weights.items()}


# ---- the spec against the loaders ------------------------------------------------------------

def test_spec_names_and_shapes_are_what_the_gguf_loader_gives() -> None:
    ck = load_checkpoint(STORIES_GGUF)
    spec = ck.config.arch
    assert spec.name == "llama" and not ck.config.tie_word_embeddings
    assert _shapes(ck.weights) == spec.expected_shapes(ck.config)
    # Every tensor of the file is a weight of the spec, and the mapping goes both ways.
    file_names = [t.name for t in gguf.GGUFReader(STORIES_GGUF).tensors]
    assert {spec.from_gguf(n) for n in file_names} == set(ck.weights)
    assert all(spec.to_gguf(spec.from_gguf(n)) == n for n in file_names)
    assert spec.from_gguf("rope_freqs.weight") is None and spec.from_gguf("blk.x.attn_q.weight") is None


@pytest.mark.parametrize(("arch", "tie"), [("llama", True), ("qwen2", False), ("mistral", False)])
def test_spec_names_and_shapes_are_what_the_hf_loader_and_transformers_give(tmp_path, arch: str, tie: bool) -> None:
    model = random_hf_model(arch, seed=2, tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    write_gguf_tokenizer(STORIES_GGUF, tmp_path / "tokenizer.gguf")  # any tokenizer the loader reads
    ck = load_checkpoint(tmp_path)
    expected = ck.config.arch.expected_shapes(ck.config)
    assert ck.config.arch is ARCH_SPECS[arch] and ck.config.tie_word_embeddings == tie
    assert _shapes(ck.weights) == expected
    assert _shapes(model.state_dict()) == expected  # transformers' own names: HF names are internal ones
    assert ck.config.attention_bias == (arch == "qwen2")


def test_quantization_replaces_exactly_the_spec_projections() -> None:
    model = random_hf_model("qwen2", seed=3)
    config = model_config_from_hf(model.config, "qwen2")
    out = quantize_model(config, dict(model.state_dict()), QuantSpec(8), "rtn")
    quantized = {n for n, w in out.items() if isinstance(w, QuantizedWeight)}
    assert quantized == set(config.arch.projection_names(config))
    assert len(quantized) == 7 * config.num_layers  # q, k, v, o, gate, up, down; biases stay dense


# ---- the calibration layer against the serving layer -----------------------------------------

class _Tap:
    """A serving layer that also keeps each call's output (its MLP output plus the residual stream)."""

    def __init__(self, layer) -> None:
        self.layer, self.outputs = layer, []

    def __call__(self, hidden, residual, positions, attend):
        hidden, residual = self.layer(hidden, residual, positions, attend)
        self.outputs.append(hidden + residual)  # [N, D]
        return hidden, residual


def _prefill_step(model: LlamaModel, kv: torch.Tensor, ids: torch.Tensor, start: int, end: int) -> None:
    """One serving step that prefills tokens [start, end) of every row of ids [B, T], sequence b in
    blocks 1 + b * per_seq ..., attending to the tokens before `start` through the cache."""
    b, t = ids.shape
    per_seq = -(-t // BLOCK)
    tables = [torch.arange(1 + s * per_seq, 1 + (s + 1) * per_seq) for s in range(b)]
    n, positions = end - start, torch.arange(start, end)  # [n]
    slots = torch.cat([tables[s][positions // BLOCK] * BLOCK + positions % BLOCK for s in range(b)])  # [B * n]
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=0, decode_block_tables=torch.zeros(0, 1).long(),
                             decode_context_lens=torch.zeros(0).long(),
                             prefills=tuple(PrefillSpan(s * n, n, end, tables[s]) for s in range(b)))
    model.forward(ids[:, start:end].reshape(-1), positions.repeat(b), meta, kv)


def _serving_layer_outputs(config: ModelConfig, weights: dict, ids: torch.Tensor, split: int) -> list[torch.Tensor]:
    """Each layer's output [B, T, D] in the serving model, over two paged steps (the second one a
    chunk that reads the first one's KV from the cache)."""
    model = LlamaModel(config, weights)
    model.layers = taps = [_Tap(layer) for layer in model.layers]
    b, t = ids.shape
    kv = allocate_kv_cache(config, CacheConfig(block_size=BLOCK, num_blocks=1 + b * -(-t // BLOCK)), "cpu")
    _prefill_step(model, kv, ids, 0, split)
    _prefill_step(model, kv, ids, split, t)
    return [torch.cat([o.view(b, -1, config.hidden_size) for o in tap.outputs], dim=1) for tap in taps]


def _calibration_layer_outputs(config: ModelConfig, weights: dict, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's output [B, T, D] as GPTQ calibration computes it (dense, whole sequences)."""
    ctx = layer_context(config, torch_ops)
    x = F.embedding(ids, weights[config.arch.global_name("embed")])
    outputs = []
    for i in range(config.num_layers):
        x = dense_forward(build_layer(config, weights, i, ctx), x)
        outputs.append(x)
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_calibration_layer_forward_equals_the_serving_layer(arch: str) -> None:
    model = random_hf_model(arch, seed=6, num_hidden_layers=3)
    config = model_config_from_hf(model.config, arch)
    weights = dict(model.state_dict())
    ids = torch.randint(3, config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(0))  # [B, T]
    calibration = _calibration_layer_outputs(config, weights, ids)
    serving = _serving_layer_outputs(config, weights, ids, split=13)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True).hidden_states  # embeddings, layers 0..L-2, final norm
    for i, (calib, serve) in enumerate(zip(calibration, serving)):
        torch.testing.assert_close(calib, serve, rtol=1e-5, atol=1e-5, msg=f"layer {i}")
        if i < config.num_layers - 1:
            torch.testing.assert_close(calib, reference[i + 1], rtol=1e-5, atol=1e-5, msg=f"layer {i} vs transformers")
