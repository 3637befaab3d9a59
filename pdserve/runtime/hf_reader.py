"""HF checkpoint directories: config.json + *.safetensors (single or sharded) + tokenizer files.

GPTQ-quantized directories (a `quantization_config`, `*.qweight` tensors) load too: their projections
come back as `pdserve.quant.gptq_format.QuantizedWeight`s. A directory made by `pdserve quantize`
from a GGUF file carries that file's tokenizer as `tokenizer.gguf` (vocabulary metadata only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pdserve.runtime.arch import ARCH_SPECS, ArchSpec, spec_for_hf_class
from pdserve.runtime.config import ConfigError, ModelConfig
from pdserve.runtime.loader import ModelLoadError
from pdserve.runtime.tokenizer import HFTokenizer

INDEX_FILE = "model.safetensors.index.json"


GGUF_TOKENIZER_FILE = "tokenizer.gguf"


def read_hf_directory(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor], HFTokenizer, list[Path]]:
    config, tokenizer, files = read_hf_meta(path)
    weights = read_weights(files, config, dtype)
    weights |= _read_quantized(path, files, config, dtype)
    return config, weights, tokenizer, files


def read_hf_meta(path: Path) -> tuple[ModelConfig, HFTokenizer, list[Path]]:
    """Config, tokenizer and weight files of a directory, without reading any weights."""
    config = read_config(path / "config.json")
    files = weight_files(path)
    if (path / GGUF_TOKENIZER_FILE).exists() and not (path / "tokenizer_config.json").exists():
        from pdserve.runtime.gguf_reader import load_gguf_tokenizer

        return config, load_gguf_tokenizer(path / GGUF_TOKENIZER_FILE), files
    try:
        tokenizer = HFTokenizer.from_directory(path, config.eos_token_ids)
    except Exception as e:  # transformers raises OSError/ValueError/... for missing or bad files
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})".splitlines()[0]) from e
    return config, tokenizer, files


def _read_quantized(path: Path, files: list[Path], config: ModelConfig, dtype: torch.dtype) -> dict:
    """The GPTQ-quantized projections, if the checkpoint has any; config and tensors must agree."""
    from pdserve.quant import gptq_format as gf
    from pdserve.quant.spec import QuantError

    try:
        qc = gf.read_quant_config(path, json.loads((path / "config.json").read_text()))
        if qc is None:
            if gf.has_quantized_tensors(files):
                raise QuantError("tensors are GPTQ-quantized (*.qweight) but there is no quantization_config "
                                 f"in config.json nor a {gf.QUANT_CONFIG_FILE}")
            return {}
        return gf.read_quantized_linears(files, config, qc, dtype)
    except QuantError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def read_config(file: Path) -> ModelConfig:
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{file}: missing (an HF checkpoint directory needs config.json)") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e
    spec = _architecture(file, raw)
    _refuse_unsupported_features(file, raw)
    try:
        heads = int(raw["num_attention_heads"])
        return ModelConfig(
            architecture=spec.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_parameters(raw).get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", spec.tie_word_embeddings)),
            # Qwen2 always has q/k/v biases; Llama may opt in with attention_bias.
            attention_bias=spec.attention_bias or bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"{file}: missing key {e.args[0]!r}") from e
    except (ConfigError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{file}: {e}") from e


def _architecture(file: Path, raw: dict[str, Any]) -> ArchSpec:
    names = raw.get("architectures") or []
    for name in names:
        spec = spec_for_hf_class(name)
        if spec is not None:
            return spec
    shown = names[0] if names else raw.get("model_type")
    supported = (c for s in ARCH_SPECS.values() for c in s.hf_classes)
    raise ModelLoadError(f"{file}: unsupported architecture {shown!r} (supported: {', '.join(supported)})")


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters; older configs write rope_theta and rope_scaling.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _refuse_unsupported_features(file: Path, raw: dict[str, Any]) -> None:
    """Options our forward pass does not implement: refuse rather than compute something else."""
    rope = _rope_parameters(raw)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(f"{file}: unsupported RoPE scaling {rope_type!r}")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{file}: unsupported mlp_bias=true")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{file}: unsupported hidden_act {raw['hidden_act']!r} (only silu)")


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files: those the shard index names, else every *.safetensors, sorted."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid shard index ({e})") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{f}: missing (listed in {INDEX_FILE})")
    return files


def read_weights(files: list[Path], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors the config's spec names; extra ones (e.g. rotary inv_freq buffers) are ignored.
    A tied head is made the embedding by `loader.tie_head`."""
    from safetensors import safe_open

    wanted = set(config.arch.expected_shapes(config))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in wanted.intersection(st.keys()):
                    weights[name] = st.get_tensor(name).to(dtype).contiguous()
        except Exception as e:  # SafetensorError for bad headers, truncation, bad offsets
            raise ModelLoadError(f"{f}: corrupt or truncated safetensors file ({e})".splitlines()[0]) from e
    return weights
