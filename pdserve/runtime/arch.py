"""Architecture specs: the weights each supported decoder has, their names and shapes, and its options.

One frozen `ArchSpec` per `ModelConfig.architecture` (reach it as `config.arch`). It names every
tensor three ways: the role the forward knows it by ("q", "input_norm", "embed"), its name in HF
checkpoints, and its name in GGUF files. The HF name is also the tensor's key in
`Checkpoint.weights` (what `LlamaForCausalLM.state_dict()` holds and what GPTQ checkpoints use), so
the HF <-> internal mapping is the identity and GGUF names are mapped onto HF ones. The loaders,
the model (`runtime.model`) and quantization read names, shapes and the fused matmuls ("sites")
from here instead of spelling them.

Adding an architecture: a spec below (its tensors, HF class names, GGUF name, options) and, for a
new forward option, its branch in `runtime.model.DecoderLayer`. Free of torch, like `config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.runtime.config import ModelConfig

Shape = Callable[["ModelConfig"], tuple[int, ...]]
# Layer tensors are named "<prefix><i>.<name>" in each format.
HF_LAYER_PREFIX = "model.layers."
GGUF_LAYER_PREFIX = "blk."
_LAYER_PREFIX = {"hf": HF_LAYER_PREFIX, "gguf": GGUF_LAYER_PREFIX}


def _always(config: ModelConfig) -> bool:
    return True


def _has_bias(config: ModelConfig) -> bool:
    return config.attention_bias


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One weight tensor; a layer tensor's names are relative to its layer's prefix."""

    role: str  # the forward's name for it
    hf: str  # name in HF checkpoints, and key in Checkpoint.weights
    gguf: str  # name in llama.cpp's GGUF files
    shape: Shape  # (out_features, in_features) for a matrix
    present: Callable[[ModelConfig], bool] = _always  # whether a checkpoint of this config has it
    # Q/K rows (weight and bias): how many heads llama.cpp interleaves them over for RoPE.
    rope_heads: Callable[[ModelConfig], int] | None = None


@dataclass(frozen=True, slots=True)
class LinearSite:
    """One matmul of the layer: projections reading the same input, fused along their outputs.

    `name` is the `DecoderLayer` field that holds it; GPTQ quantizes a site's projections together
    (one Hessian of their shared input), so the sites are quantization's stages too."""

    name: str
    weights: tuple[str, ...]  # roles of the weights, in output order; these are the quantizable linears
    biases: tuple[str, ...] = ()  # roles of their biases, used where the config has them


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """One architecture: where its checkpoints come from, its forward options, its tensors and sites."""

    name: str  # ModelConfig.architecture
    hf_classes: tuple[str, ...]  # config.json "architectures" entries read as this spec (first: the one we write)
    gguf_arch: str | None  # GGUF general.architecture read as this spec (None: llama.cpp writes it as another)
    gguf_permuted_qk: bool  # llama.cpp's converter interleaves Q/K rows ("normal" RoPE); undone on load
    # Forward options.
    attention_bias: bool  # q/k/v biases whatever config.json says (Qwen2); else the checkpoint decides
    tie_word_embeddings: bool  # whether the head is the embedding when config.json does not say
    qk_norm: bool  # RMSNorm per head on q and k before RoPE (Qwen3); no spec sets it yet
    global_tensors: tuple[TensorSpec, ...]
    layer_tensors: tuple[TensorSpec, ...]
    sites: tuple[LinearSite, ...]  # in forward order

    def global_name(self, role: str) -> str:
        return _by_role(self.global_tensors, role).hf

    def layer_name(self, i: int, role: str) -> str:
        return f"{HF_LAYER_PREFIX}{i}.{_by_role(self.layer_tensors, role).hf}"

    def layer_tensor(self, role: str) -> TensorSpec:
        return _by_role(self.layer_tensors, role)

    def global_tensor(self, role: str) -> TensorSpec:
        return _by_role(self.global_tensors, role)

    def layer_names(self, config: ModelConfig, i: int) -> list[str]:
        """HF names of layer i's tensors that a checkpoint of `config` has."""
        return [f"{HF_LAYER_PREFIX}{i}.{t.hf}" for t in self.layer_tensors if t.present(config)]

    def expected_shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every weight a checkpoint of `config` must provide (HF names), with its shape."""
        shapes = {t.hf: t.shape(config) for t in self.global_tensors if t.present(config)}
        for i in range(config.num_layers):
            shapes |= {f"{HF_LAYER_PREFIX}{i}.{t.hf}": t.shape(config)
                       for t in self.layer_tensors if t.present(config)}
        return shapes

    def site_in_features(self, site: LinearSite, config: ModelConfig) -> int:
        return self.layer_tensor(site.weights[0]).shape(config)[1]

    def projection_names(self, config: ModelConfig) -> list[str]:
        """HF names of the quantizable linears (every site's weights), layer by layer."""
        return [self.layer_name(i, role) for i in range(config.num_layers)
                for site in self.sites for role in site.weights]

    def from_gguf(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor; None for one the model does not use."""
        return _translate(self, gguf_name, "gguf", "hf")

    def to_gguf(self, hf_name: str) -> str | None:
        return _translate(self, hf_name, "hf", "gguf")

    def gguf_permuted_heads(self, hf_name: str, config: ModelConfig) -> int | None:
        """Heads over which llama.cpp interleaved this tensor's rows, or None when it did not."""
        layer = _split_layer(hf_name, HF_LAYER_PREFIX)
        if not self.gguf_permuted_qk or layer is None:
            return None
        t = next((t for t in self.layer_tensors if t.hf == layer[1]), None)
        return t.rope_heads(config) if t is not None and t.rope_heads is not None else None


def _by_role(tensors: tuple[TensorSpec, ...], role: str) -> TensorSpec:
    for t in tensors:
        if t.role == role:
            return t
    raise KeyError(f"no tensor with role {role!r}")


def _split_layer(name: str, prefix: str) -> tuple[str, str] | None:
    """"<prefix><i>.<rest>" -> (i, rest); None for a name outside the layers."""
    if not name.startswith(prefix):
        return None
    index, _, rest = name[len(prefix):].partition(".")
    return (index, rest) if index.isdigit() and rest else None


def _translate(spec: ArchSpec, name: str, src: str, dst: str) -> str | None:
    """A tensor's name in format `dst` ("hf" | "gguf") from its name in format `src`."""
    for t in spec.global_tensors:
        if getattr(t, src) == name:
            return getattr(t, dst)
    layer = _split_layer(name, _LAYER_PREFIX[src])
    if layer is not None:
        for t in spec.layer_tensors:
            if getattr(t, src) == layer[1]:
                return f"{_LAYER_PREFIX[dst]}{layer[0]}.{getattr(t, dst)}"
    return None


def _q(c: ModelConfig) -> int:
    return c.num_heads * c.head_dim


def _kv(c: ModelConfig) -> int:
    return c.num_kv_heads * c.head_dim


def _heads(c: ModelConfig) -> int:
    return c.num_heads


def _kv_heads(c: ModelConfig) -> int:
    return c.num_kv_heads


_GLOBAL = (
    TensorSpec("embed", "model.embed_tokens.weight", "token_embd.weight", lambda c: (c.vocab_size, c.hidden_size)),
    TensorSpec("final_norm", "model.norm.weight", "output_norm.weight", lambda c: (c.hidden_size,)),
    # Always expected: the loader makes a tied head the embedding itself.
    TensorSpec("lm_head", "lm_head.weight", "output.weight", lambda c: (c.vocab_size, c.hidden_size)),
)
_LAYER = (
    TensorSpec("input_norm", "input_layernorm.weight", "attn_norm.weight", lambda c: (c.hidden_size,)),
    TensorSpec("q", "self_attn.q_proj.weight", "attn_q.weight", lambda c: (_q(c), c.hidden_size), rope_heads=_heads),
    TensorSpec("k", "self_attn.k_proj.weight", "attn_k.weight", lambda c: (_kv(c), c.hidden_size), rope_heads=_kv_heads),
    TensorSpec("v", "self_attn.v_proj.weight", "attn_v.weight", lambda c: (_kv(c), c.hidden_size)),
    TensorSpec("q_bias", "self_attn.q_proj.bias", "attn_q.bias", lambda c: (_q(c),), _has_bias, _heads),
    TensorSpec("k_bias", "self_attn.k_proj.bias", "attn_k.bias", lambda c: (_kv(c),), _has_bias, _kv_heads),
    TensorSpec("v_bias", "self_attn.v_proj.bias", "attn_v.bias", lambda c: (_kv(c),), _has_bias),
    TensorSpec("o", "self_attn.o_proj.weight", "attn_output.weight", lambda c: (c.hidden_size, _q(c))),
    TensorSpec("post_norm", "post_attention_layernorm.weight", "ffn_norm.weight", lambda c: (c.hidden_size,)),
    TensorSpec("gate", "mlp.gate_proj.weight", "ffn_gate.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    TensorSpec("up", "mlp.up_proj.weight", "ffn_up.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    TensorSpec("down", "mlp.down_proj.weight", "ffn_down.weight", lambda c: (c.hidden_size, c.intermediate_size)),
)
_SITES = (
    LinearSite("qkv", ("q", "k", "v"), ("q_bias", "k_bias", "v_bias")),
    LinearSite("o", ("o",)),
    LinearSite("gate_up", ("gate", "up")),
    LinearSite("down", ("down",)),
)

LLAMA = ArchSpec(
    name="llama", hf_classes=("LlamaForCausalLM",), gguf_arch="llama", gguf_permuted_qk=True,
    attention_bias=False, tie_word_embeddings=False, qk_norm=False,
    global_tensors=_GLOBAL, layer_tensors=_LAYER, sites=_SITES)
# llama.cpp writes Mistral GGUFs as "llama", so only HF directories load as "mistral".
MISTRAL = replace(LLAMA, name="mistral", hf_classes=("MistralForCausalLM",), gguf_arch=None)
QWEN2 = replace(LLAMA, name="qwen2", hf_classes=("Qwen2ForCausalLM",), gguf_arch="qwen2",
                gguf_permuted_qk=False, attention_bias=True)

ARCH_SPECS: dict[str, ArchSpec] = {s.name: s for s in (LLAMA, MISTRAL, QWEN2)}
ARCHITECTURES = tuple(ARCH_SPECS)


def spec_for_hf_class(name: str) -> ArchSpec | None:
    return next((s for s in ARCH_SPECS.values() if name in s.hf_classes), None)


def spec_for_gguf(arch: str) -> ArchSpec | None:
    return next((s for s in ARCH_SPECS.values() if s.gguf_arch == arch), None)
