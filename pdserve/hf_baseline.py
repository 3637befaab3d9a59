"""The transformers model on the same weights as a pdserve Checkpoint: the baseline to beat
and the reference to match."""

from __future__ import annotations

import torch

from pdserve.runtime.config import ModelConfig


def hf_config(config: ModelConfig):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[config.architecture]
    extra = {"sliding_window": None} if config.architecture != "llama" else {"head_dim": config.head_dim}
    return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
               intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
               num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
               rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
               max_position_embeddings=config.max_position_embeddings,
               tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
               eos_token_id=list(config.eos_token_ids), pad_token_id=0, **extra)


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """A transformers CausalLM (eval) holding `weights`, in their dtype (a bf16 checkpoint: a bf16
    model, so that a baseline runs what the engine runs; it was fp32 whatever the weights before)."""
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[config.architecture]
    dtype = next((v.dtype for v in weights.values() if v.is_floating_point()), torch.float32)
    model = cls(hf_config(config)).eval().to(dtype)
    state = {k: v for k, v in weights.items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    model.load_state_dict(state, strict=False)
    return model
