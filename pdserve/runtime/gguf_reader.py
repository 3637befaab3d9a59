"""GGUF (llama.cpp) checkpoints: hyper-parameters, weights (quantized ones dequantized), tokenizer.

Architectures: the specs of `runtime.arch` with a GGUF name, ``llama`` (Llama 1/2/3 without RoPE
scaling, Mistral, SmolLM: llama.cpp writes them all as "llama") and ``qwen2`` (q/k/v biases); the
spec maps GGUF tensor names onto HF ones and says whose Q/K rows llama.cpp permuted. Tensor types:
`SUPPORTED_TYPES`, dequantized by the `gguf` package into the requested dtype (the engine may keep
the projections' codes packed instead: pdserve.quant.gguf_packed re-reads them, through the tensor
table this parse keeps, `runtime.gguf_tensors`), each when first asked for (`runtime.lazy_weights`).
The header is read by `runtime.gguf_header` (gguf's reader took 2.75 s a parse for SmolLM2's
vocabulary; that module says why and how it is checked). Anything else, and a block type's data that
is not whole blocks, is refused with a one-line `ModelLoadError` that names the file and the problem.
Reading a file's header (config, tokenizer: `read_gguf_meta`, the gateway's) imports no torch.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from pdserve.runtime import gguf_tensors
from pdserve.runtime.gguf_header import GGUFHeader, TensorPlace, parse
from pdserve.runtime.arch import ARCH_SPECS, ArchSpec, spec_for_gguf
from pdserve.runtime.config import ConfigError, ModelConfig
from pdserve.runtime.loader import ModelLoadError
from pdserve.runtime.gguf_vocab import VocabError, build_tokenizer
from pdserve.runtime.lazy_weights import LazyWeights
from pdserve.runtime.tokenizer import GGUFTokenizer

if TYPE_CHECKING:  # the weights' functions import it: reading a header (the gateway's) needs no torch
    import torch

UNSET_ID = 0xFFFFFFFF  # llama.cpp writes this for "no such token"
_T = GGMLQuantizationType
# What llama.cpp's common presets (Q4_K_M, Q5_K_M, Q8_0, ...) contain.
SUPPORTED_TYPES = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1,
                             _T.Q4_K, _T.Q5_K, _T.Q6_K})
ARCHITECTURES = tuple(s.gguf_arch for s in ARCH_SPECS.values() if s.gguf_arch)
# End-of-turn tokens of common chat templates: generation ends on them when the template uses them.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

def read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFTokenizer, list[Path]]:
    header, config, tokenizer = _read_header(path)
    weights = read_weights(path, header.tensors, config, dtype)
    return config, weights, tokenizer, [path]


def read_gguf_meta(path: Path) -> tuple[ModelConfig, GGUFTokenizer, list[Path]]:
    """Config, tokenizer and the file itself, without reading any tensor."""
    _, config, tokenizer = _read_header(path)
    return config, tokenizer, [path]


def _read_header(path: Path) -> tuple[GGUFHeader, ModelConfig, GGUFTokenizer]:
    header = _open(path)
    gguf_tensors.remember(path, header)  # the engine reads the tensors again (packed codes, the head type)
    meta = _Metadata(path, header)
    arch = meta.get("general.architecture")
    if spec_for_gguf(arch) is None:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    tokenizer = read_tokenizer(meta)
    return header, read_config(meta, header.tensors, tokenizer), tokenizer


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Only the tokenizer of a GGUF file (the tensors are memory-mapped, not read)."""
    path = Path(path)
    return read_tokenizer(_Metadata(path, _open(path)))


def _open(path: Path) -> GGUFHeader:
    try:
        return parse(path)
    except Exception as e:  # the parse raises ValueError/struct.error/... on any malformed byte
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e


class _Metadata:
    """Typed access to a GGUF file's key-value metadata, with errors that name the file."""

    def __init__(self, path: Path, header: GGUFHeader) -> None:
        self.path, self._values = path, header.metadata

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: missing GGUF metadata key {key}")
        return value

    def token_id(self, key: str) -> int | None:
        value = self.get(key)
        return None if value is None or int(value) == UNSET_ID else int(value)


def read_tokenizer(meta: _Metadata) -> GGUFTokenizer:
    tokens = meta.require("tokenizer.ggml.tokens")
    try:
        backend = build_tokenizer(meta.get("tokenizer.ggml.model"), tokens, meta.get("tokenizer.ggml.token_type", []),
                                  scores=meta.get("tokenizer.ggml.scores", []),
                                  merges=meta.get("tokenizer.ggml.merges", []), pre=meta.get("tokenizer.ggml.pre"))
    except VocabError as e:
        raise ModelLoadError(f"{meta.path}: {e}") from e
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(
        backend,
        bos_id=meta.token_id("tokenizer.ggml.bos_token_id"),
        eos_ids=_eos_ids(meta, tokens, template),
        unk_id=meta.token_id("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        chat_template=template,
    )


def _eos_ids(meta: _Metadata, tokens: list[str], template: str | None) -> tuple[int, ...]:
    """EOS and EOT from the metadata, then the chat template's end-of-turn token (ChatML's
    `<|im_end|>`, ...): a chat model ends its answer with it, whatever the file calls EOS."""
    ids = [meta.token_id("tokenizer.ggml.eos_token_id"), meta.token_id("tokenizer.ggml.eot_token_id")]
    if template:
        index = {t: i for i, t in enumerate(tokens) if t in _END_OF_TURN}
        ids += [index[t] for t in _END_OF_TURN if t in index and t in template]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def read_config(meta: _Metadata, tensors: tuple[TensorPlace, ...], tokenizer: GGUFTokenizer) -> ModelConfig:
    arch = meta.require("general.architecture")
    spec = spec_for_gguf(arch)
    key = lambda name: f"{arch}.{name}"  # noqa: E731 - hyper-parameters are keyed by architecture
    hidden = int(meta.require(key("embedding_length")))
    heads = int(meta.require(key("attention.head_count")))
    _refuse_rope_scaling(meta, tensors, arch)
    try:
        return ModelConfig(
            architecture=spec.name,
            vocab_size=tokenizer.vocab_size,
            hidden_size=hidden,
            intermediate_size=int(meta.require(key("feed_forward_length"))),
            num_layers=int(meta.require(key("block_count"))),
            num_heads=heads,
            num_kv_heads=int(meta.get(key("attention.head_count_kv"), heads)),
            head_dim=int(meta.get(key("attention.key_length"), hidden // heads)),
            rms_norm_eps=_float32(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-5)),
            rope_theta=_float32(meta.get(key("rope.freq_base"), 10000.0)),
            max_position_embeddings=int(meta.get(key("context_length"), 2048)),
            tie_word_embeddings=not _has_tensor(tensors, spec, "lm_head"),
            attention_bias=_has_tensor(tensors, spec, "q_bias"),
            bos_token_id=tokenizer.bos_id,
            eos_token_ids=tokenizer.eos_ids,
        )
    except ConfigError as e:
        raise ModelLoadError(f"{meta.path}: {e}") from e


def _has_tensor(tensors: tuple[TensorPlace, ...], spec: ArchSpec, role: str) -> bool:
    """Whether the file holds the tensor of `role` (of any layer, for a layer tensor)."""
    if any(t.role == role for t in spec.global_tensors):
        return any(t.name == spec.global_tensor(role).gguf for t in tensors)
    suffix = "." + spec.layer_tensor(role).gguf
    return any(t.name.endswith(suffix) for t in tensors)


def _refuse_rope_scaling(meta: _Metadata, tensors: tuple[TensorPlace, ...], arch: str) -> None:
    """RoPE scaling (linear, YaRN, Llama 3's) is not implemented: refuse it rather than ignore it."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{meta.path}: unsupported RoPE scaling {scaling!r}")
    if any(t.name == "rope_freqs.weight" for t in tensors):  # how llama.cpp stores Llama 3's
        raise ModelLoadError(f"{meta.path}: unsupported RoPE scaling 'llama3' (tensor rope_freqs.weight)")


def _float32(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; keep the value that was meant."""
    return float(str(np.float32(value)))


def read_weights(path: Path, places: tuple[TensorPlace, ...], config: ModelConfig, dtype: torch.dtype
                 ) -> LazyWeights:
    """The tensors the spec names, under their HF names, Q/K rows back in HF order, each read and
    dequantized when first asked for (runtime.lazy_weights: an engine on the 4-bit codes never asks
    for its projections); types and block sizes are checked now. A tied head is made the embedding
    by `loader.tie_head`."""
    from pdserve.quant.gguf_packed import PackedFormatError, check_blocks

    spec = config.arch
    loaders = {}
    for t in gguf_tensors.views(path, places):  # the header's tensors over one fresh mapping
        name = spec.from_gguf(t.name)
        if name is None:
            continue  # not a weight of the HF model
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported GGML type {t.tensor_type.name} "
                                 f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:  # a block type's data must be whole blocks of the right size: else gguf's numpy errors
            check_blocks(int(t.tensor_type), shape, t.data.nbytes)
        except PackedFormatError as e:
            raise ModelLoadError(f"{path}: tensor {t.name}: {e}") from e
        loaders[name] = (shape, partial(_load, t, spec.gguf_permuted_heads(name, config), dtype))
    return LazyWeights(loaders)


def _load(t: Any, heads: int | None, dtype: torch.dtype) -> torch.Tensor:
    w = _to_torch(t).to(dtype)
    if heads is not None:
        w = unpermute_rope_rows(w, heads)
    return w.contiguous()


def _to_torch(t: Any) -> torch.Tensor:
    """The tensor in numpy's (row-major) order, float32 (BF16 stays bfloat16).

    GGUF lists dims fastest-first, so the shape is reversed; quantized blocks are dequantized by
    `gguf.quants.dequantize`, which takes the rows of packed bytes the reader hands out.
    """
    import torch

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = np.asarray(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:
        # numpy has no bfloat16: the reader hands out raw bytes; reinterpret them.
        raw = torch.from_numpy(data.reshape(-1).view(np.int16).copy())
        return raw.view(torch.bfloat16).reshape(shape)
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(data.copy()).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(dequantize(data, t.tensor_type))).reshape(shape)


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves).

    llama.cpp's converter reorders each head's rows [x0..x(d/2-1), y0..y(d/2-1)] into
    [x0, y0, x1, y1, ...]; we read the rows as (head, d/2, 2) and swap back to (head, 2, d/2).
    w: [n_heads * head_dim, in] (or [n_heads * head_dim] for a bias) -> same shape.
    """
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)
