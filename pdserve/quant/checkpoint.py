"""Writing a quantized checkpoint directory that `load_checkpoint` (and AutoGPTQ-style tools) read:

    model.safetensors      GPTQ tensors for the decoder projections (W8A8: + input_scale/input_zero_point),
                           dense `.weight`s for projections a `dynamic` rule leaves unquantized, the rest
                           as in the source
    config.json            the model config + `quantization_config` (format and provenance)
    quantize_config.json   the same quantization config (where AutoGPTQ looks for it)
    tokenizer files        the source's HF tokenizer files, or `tokenizer.gguf` for a GGUF source
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pdserve.quant.gptq_format import QUANT_CONFIG_FILE, QuantizedWeight, module_name
from pdserve.quant.int8_act import Int8ActWeight
from pdserve.quant.spec import ActSpec, QuantSpec
from pdserve.runtime.hf_reader import GGUF_TOKENIZER_FILE


def quantization_config(spec: QuantSpec, method: str, damp_percent: float, provenance: dict[str, Any],
                        dynamic: dict[str, dict] | None = None, activations: ActSpec | None = None) -> dict[str, Any]:
    """The `quantization_config`: AutoGPTQ's keys (what loaders need), then how pdserve made it.

    dynamic: GPTQModel's per-module overrides (regex -> fields; "-:" = not quantized), as GPTQModel
    and vLLM read them. activations: W8A8's input quantization, in `pdserve.activations`."""
    qc = {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": spec.bits, "group_size": spec.group_size,
        "desc_act": spec.desc_act, "sym": spec.sym, "static_groups": False, "true_sequential": True,
        "damp_percent": damp_percent, "method": method, "pdserve": provenance,
    }
    if dynamic:
        qc["dynamic"] = dynamic
    if activations is not None:
        qc["pdserve"] = provenance | {"activations": activations.to_json()}
    return qc


def state_dict(weights: dict, tied_head: str | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors: QuantizedWeights expand to qweight/qzeros/scales/g_idx (W8A8 ones add
    input_scale/input_zero_point); `tied_head`, the name of a head that is the embedding itself, is
    left out (a falsy value leaves nothing out)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if tied_head and name == tied_head:
            continue
        if isinstance(w, (QuantizedWeight, Int8ActWeight)):
            out |= w.tensors(module_name(name))
        else:
            out[name] = w.detach().contiguous()
    return out


def model_config_json(checkpoint) -> dict[str, Any]:
    """The source's config.json when it has one, else the HF config our ModelConfig stands for."""
    src = checkpoint.source
    if src.is_dir() and (src / "config.json").exists():
        raw = json.loads((src / "config.json").read_text())
        raw.pop("quantization_config", None)
        return raw
    from pdserve.hf_baseline import hf_config

    raw = hf_config(checkpoint.config).to_dict()
    raw["architectures"] = [checkpoint.config.arch.hf_classes[0]]
    return raw


def save_tokenizer(checkpoint, out_dir: Path) -> None:
    src = checkpoint.source
    if src.is_dir() and (src / GGUF_TOKENIZER_FILE).is_file():  # a quantized directory made from a GGUF
        (out_dir / GGUF_TOKENIZER_FILE).write_bytes((src / GGUF_TOKENIZER_FILE).read_bytes())
    elif src.is_dir():
        checkpoint.tokenizer._tok.save_pretrained(str(out_dir))  # HFTokenizer wraps transformers'
    else:
        write_gguf_tokenizer(src, out_dir / GGUF_TOKENIZER_FILE)


def write_gguf_tokenizer(gguf_path: Path, out: Path) -> None:
    """A GGUF file holding only the source's tokenizer.* metadata (no tensors): what our GGUF
    tokenizer reads, with nothing lost in a conversion."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def save_quantized(out_dir: str | Path, checkpoint, weights: dict, qconfig: dict[str, Any]) -> Path:
    """Writes the directory; returns its path."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = checkpoint.config
    tied_head = config.arch.global_name("lm_head") if config.tie_word_embeddings else None
    save_file(state_dict(weights, tied_head), str(out / "model.safetensors"),
              metadata={"format": "pt", "quantization": "gptq"})
    config_json = model_config_json(checkpoint) | {"quantization_config": qconfig}
    (out / "config.json").write_text(json.dumps(config_json, indent=2, default=str) + "\n")
    (out / QUANT_CONFIG_FILE).write_text(json.dumps(qconfig, indent=2) + "\n")
    save_tokenizer(checkpoint, out)
    return out
