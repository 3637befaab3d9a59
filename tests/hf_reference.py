"""transformers as a reference for GGUF checkpoints, with the workarounds it needs.

Two problems keep `from_pretrained(dir, gguf_file=name)` from loading stories260K.gguf as is:

- the file sets `tokenizer.ggml.padding_token_id` and `tokenizer.ggml.seperator_token_id` to
  0xFFFFFFFF, llama.cpp's "unset"; transformers takes it for a real id and indexes the vocab with it
  (IndexError in the tokenizer, a warning in the config). `patched_gguf` writes a copy of the file
  without those keys, with the `gguf` package's writer, so nothing inside transformers is patched.
- `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` insists on `accelerate`, which is not a
  dependency of pdserve. Without it we take the same route by hand: the config from the GGUF, an empty
  model, then transformers' own GGUF tensor conversion (`load_gguf_checkpoint`, what `from_pretrained`
  calls for llama files, reverse Q/K permutation included).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import torch

# Metadata keys whose 0xFFFFFFFF ("unset") value transformers mistakes for a token id.
_UNSET_ID = 0xFFFFFFFF
_ID_KEYS = (
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.separator_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)


def _is_unset_id(field: gguf.ReaderField) -> bool:
    return field.name in _ID_KEYS and int(field.contents()) == _UNSET_ID


def _has_unset_ids(path: Path) -> bool:
    """Whether the file sets one of `_ID_KEYS` to 0xFFFFFFFF, as transformers reads it. Its own reader
    (transformers 5) skips arrays: 0.02 s on SmolLM2, where gguf's reader builds the 49k tokens and
    merges item by item (~3 s), and this runs for every reference built from the file."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:  # older transformers: gguf's reader
        return any(_is_unset_id(f) for f in gguf.GGUFReader(path).fields.values())
    metadata, _ = read_gguf_metadata(str(path))
    return any(metadata.get(key) == _UNSET_ID for key in _ID_KEYS)


def patched_gguf(gguf_path: str | Path, tmp_dir: str | Path) -> Path:
    """A copy of `gguf_path` in `tmp_dir` without the token-id keys set to 0xFFFFFFFF (the file
    itself when it has none)."""
    src = Path(gguf_path)
    dst = Path(tmp_dir) / src.name
    if dst.exists():
        return dst
    if not _has_unset_ids(src):
        return src  # nothing to drop (SmolLM2): no copy of a 100 MB file
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        # GGUF.* are the header's own fields; the writer adds general.architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or _is_unset_id(field):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def load_hf_gguf_tokenizer(gguf_path: str | Path, tmp_dir: str | Path):
    """transformers' fast tokenizer built from the GGUF vocabulary."""
    from transformers import AutoTokenizer

    path = patched_gguf(gguf_path, tmp_dir)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def load_hf_gguf_model(gguf_path: str | Path, tmp_dir: str | Path):
    """transformers' causal LM with the GGUF weights, float32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = patched_gguf(gguf_path, tmp_dir)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model.eval()

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied head has no tensor of its own in the file; anything else missing is a real gap.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF reference load: missing {missing}, unexpected {unexpected}")
    return model.eval()
