"""Our own forward pass of the Llama family (Llama, Mistral, Qwen2) over a paged KV cache.

Weights come in HF naming (see `loader.Checkpoint`); q/k/v and gate/up are fused into one
matrix each so that one step is few large matmuls. Projections are "linear" objects
(`pdserve.quant.linear`): dense ones run F.linear, GPTQ-quantized ones dequantize on the fly.
The math follows transformers' LlamaForCausalLM (rotate-half RoPE, fp32 RMSNorm), which the tests hold it to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.quant.linear import Linear, as_linear, fused_linear
from pdserve.runtime.attention import AttentionMetadata
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.kernels import get_kernels, torch_ops


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: Linear  # [N, D] -> [N, (H + 2 * KVH) * hd], bias included
    o: Linear  # [N, H * hd] -> [N, D]
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # [N, D] -> [N, 2 * I]
    down: Linear  # [N, I] -> [N, D]


def _layer_weights(w: dict, i: int, bias: bool) -> LayerWeights:
    p = f"model.layers.{i}."
    attn = [w[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]
    qkv_bias = [w[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"] if bias else None
    return LayerWeights(
        input_norm=w[f"{p}input_layernorm.weight"],
        qkv=fused_linear(attn, qkv_bias),
        o=as_linear(w[f"{p}self_attn.o_proj.weight"]),
        post_norm=w[f"{p}post_attention_layernorm.weight"],
        gate_up=fused_linear([w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"]]),
        down=as_linear(w[f"{p}mlp.down_proj.weight"]),
    )


class LlamaModel:
    """Stateless forward: the KV cache and the step's metadata are passed in."""

    def __init__(self, config: ModelConfig, weights: dict, device: str = "cpu") -> None:
        """weights: HF names -> tensors, or `QuantizedWeight`s for quantized projections."""
        self.config = config
        self.kernels = get_kernels(device)
        w = {name: t.to(device) for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]  # [V, D]
        self.lm_head = w.get("lm_head.weight", self.embed)  # [V, D]
        self.final_norm = w["model.norm.weight"]
        self.layers = [_layer_weights(w, i, config.attention_bias) for i in range(config.num_layers)]
        self.cos, self.sin = torch_ops.rope_cos_sin(
            config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        c = config
        self._split = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [N] -> final hidden states [N, D]; writes the step's KV."""
        k = self.kernels
        hidden = F.embedding(input_ids, self.embed)  # [N, D]
        residual = hidden
        hidden = k.rms_norm(hidden, self.layers[0].input_norm, self.config.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            if i > 0:
                hidden, residual = k.add_rms_norm(hidden, residual, layer.input_norm, self.config.rms_norm_eps)
            hidden = self._attention(i, layer, hidden, positions, meta, kv_cache)
            hidden, residual = k.add_rms_norm(hidden, residual, layer.post_norm, self.config.rms_norm_eps)
            hidden = layer.down(k.silu_and_mul(layer.gate_up(hidden)))
        hidden, _ = k.add_rms_norm(hidden, residual, self.final_norm, self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, D] -> logits [S, V] in fp32."""
        return F.linear(hidden, self.lm_head).float()

    def _attention(self, i: int, layer: LayerWeights, hidden: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        c, k = self.config, self.kernels
        n = hidden.shape[0]
        qkv = layer.qkv(hidden)  # [N, (H + 2 KVH) * hd]
        q, key, value = qkv.split(self._split, dim=-1)
        q = q.view(n, c.num_heads, c.head_dim)
        key = key.view(n, c.num_kv_heads, c.head_dim)
        value = value.view(n, c.num_kv_heads, c.head_dim)
        q, key = k.apply_rope(q, key, positions, self.cos, self.sin)
        k.write_kv(kv_cache, i, key, value, meta.slot_mapping)
        out = torch.empty_like(q)  # [N, H, hd]
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = k.paged_decode_attention(
                q[:nd], kv_cache, i, meta.decode_block_tables, meta.decode_context_lens, self.scale)
        for p in meta.prefills:
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = k.prefill_attention(q[sl], kv_cache, i, p.block_table, p.context_len, self.scale)
        return layer.o(out.view(n, -1))
