"""load_checkpoint against transformers: the same weights under the same names, the same config."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import load_hf_gguf_model, load_hf_gguf_tokenizer
from pdserve.runtime import loader
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.loader import Checkpoint, ModelLoadError, load_checkpoint, resolve_model_path
from pdserve.runtime.tokenizer import GGUFTokenizer, HFTokenizer

GGUF = Path(__file__).resolve().parents[1].parent / "shared/models/stories260K/stories260K.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason=f"test model {GGUF} not present")
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def stories() -> Checkpoint:
    return load_checkpoint(GGUF)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tok")
    load_hf_gguf_tokenizer(GGUF, tmp).save_pretrained(tmp / "tokenizer")
    return tmp / "tokenizer"


def assert_config_matches(config: ModelConfig, hf_config, architecture: str) -> None:
    assert config.architecture == architecture
    assert config.vocab_size == hf_config.vocab_size
    assert config.hidden_size == hf_config.hidden_size
    assert config.intermediate_size == hf_config.intermediate_size
    assert config.num_layers == hf_config.num_hidden_layers
    assert config.num_heads == hf_config.num_attention_heads
    assert config.num_kv_heads == hf_config.num_key_value_heads
    assert config.head_dim == (getattr(hf_config, "head_dim", None)
                               or hf_config.hidden_size // hf_config.num_attention_heads)
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hf_config.max_position_embeddings
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    eos = hf_config.eos_token_id
    assert config.eos_token_ids == tuple(eos if isinstance(eos, list) else [eos])
    assert config.bos_token_id == hf_config.bos_token_id


def assert_weights_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, ref in reference.items():
        assert ours[name].dtype == ref.dtype, name
        assert torch.equal(ours[name], ref), name


# --- GGUF -------------------------------------------------------------------------------------


def test_gguf_matches_transformers(stories: Checkpoint, tmp_path: Path) -> None:
    model = load_hf_gguf_model(GGUF, tmp_path)
    assert_config_matches(stories.config, model.config, "llama")
    assert_weights_equal(stories.weights, model.state_dict())
    assert stories.config.rms_norm_eps == 1e-5 and stories.config.num_kv_heads == 4
    assert isinstance(stories.tokenizer, GGUFTokenizer)
    assert stories.source == GGUF.resolve()


def test_gguf_dtype(stories: Checkpoint) -> None:
    half = load_checkpoint(GGUF, dtype=torch.bfloat16)
    assert {w.dtype for w in half.weights.values()} == {torch.bfloat16}
    assert torch.equal(half.weights["model.norm.weight"], stories.weights["model.norm.weight"].bfloat16())
    assert half.fingerprint == stories.fingerprint  # a property of the files, whatever the load dtype


def test_fingerprint_is_stable(stories: Checkpoint, tmp_path: Path) -> None:
    assert len(stories.fingerprint) == 32 and int(stories.fingerprint, 16) >= 0
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(GGUF.read_bytes())
    assert load_checkpoint(copy).fingerprint == stories.fingerprint  # name and place do not count


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def write_gguf(path: Path, model, float_type=np.float16, arch: str = "llama", quantize: str = "") -> None:
    """A GGUF of a transformers Llama as llama.cpp's converter would write it (tied head: no output)."""
    cfg, sd = model.config, model.state_dict()
    src = gguf.GGUFReader(GGUF).fields
    w = gguf.GGUFWriter(path, arch)
    for key, value in [("context_length", cfg.max_position_embeddings), ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size), ("block_count", cfg.num_hidden_layers),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_string("tokenizer.ggml.model", "llama")
    for key in ("tokens", "scores", "token_type"):
        field = src[f"tokenizer.ggml.{key}"]
        w.add_key_value(field.name, field.contents(), field.types[0], sub_type=field.types[-1])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.padding_token_id", 0xFFFFFFFF)
    for name, t in sd.items():
        if name == "lm_head.weight":
            continue
        if name.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        gname = name.replace("model.embed_tokens", "token_embd").replace("model.norm", "output_norm")
        gname = gname.replace("model.layers.", "blk.")
        for hf_part, gguf_part in GGUF_NAMES.items():
            gname = gname.replace(hf_part, gguf_part)
        data = t.numpy().astype(np.float32 if t.ndim == 1 or float_type == "bf16" else float_type)
        if float_type == "bf16" and t.ndim == 2:  # numpy has no bfloat16: hand the writer raw bits
            bits = t.bfloat16().view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(gname, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif quantize and name.endswith(quantize):
            w.add_tensor(gname, gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_llama(tie: bool, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "tie_word_embeddings": tie, **overrides})).eval()


@pytest.mark.parametrize(("float_type", "torch_type"), [(np.float16, torch.float16), ("bf16", torch.bfloat16)])
def test_gguf_tied_half_precision_roundtrip(tmp_path: Path, float_type, torch_type: torch.dtype) -> None:
    model = tiny_llama(tie=True)
    write_gguf(tmp_path / "tiny.gguf", model, float_type)
    ck = load_checkpoint(tmp_path / "tiny.gguf")
    expected = {k: (v.to(torch_type).float() if v.ndim == 2 else v) for k, v in model.state_dict().items()}
    assert_weights_equal(ck.weights, expected)
    assert ck.config.tie_word_embeddings
    assert ck.weights["lm_head.weight"] is ck.weights["model.embed_tokens.weight"]
    assert ck.tokenizer.eos_ids == (2,)


def test_gguf_quantized_is_refused(tmp_path: Path) -> None:
    write_gguf(tmp_path / "q.gguf", tiny_llama(tie=True), np.float32, quantize="mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"q\.gguf.*blk\.0\.ffn_up\.weight.*Q8_0"):
        load_checkpoint(tmp_path / "q.gguf")


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    write_gguf(tmp_path / "other.gguf", tiny_llama(tie=True), np.float32, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"other\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(tmp_path / "other.gguf")


@pytest.mark.parametrize("content", [os.urandom(4096), b"", GGUF.read_bytes()[:20000]],
                         ids=["random", "empty", "truncated"])
def test_gguf_corrupt(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "x.gguf").write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"x\.gguf: corrupt or truncated GGUF file") as e:
        load_checkpoint(tmp_path / "x.gguf")
    assert "\n" not in str(e.value)


# --- HF directories ---------------------------------------------------------------------------


def make_hf_dir(tmp: Path, arch: str, tie: bool, tokenizer_dir: Path, **save_kwargs) -> tuple[Path, object]:
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    extra = {"eos_token_id": [2, 7], "rope_theta": 5e5} if arch == "llama" else {}
    if arch == "mistral":
        extra["head_dim"] = 16  # not hidden/heads: read from the config, not derived
    torch.manual_seed(1)
    model = model_cls(config_cls(**{**TINY, "tie_word_embeddings": tie, **extra})).eval()
    d = tmp / f"{arch}-{'tied' if tie else 'untied'}"
    model.save_pretrained(d, **save_kwargs)
    for f in tokenizer_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    return d, model


@pytest.mark.parametrize(("arch", "tie"), [("llama", False), ("llama", True), ("qwen2", False),
                                           ("qwen2", True), ("mistral", False)])
def test_hf_directory_matches_transformers(tmp_path: Path, hf_tokenizer_dir: Path, arch: str, tie: bool) -> None:
    d, model = make_hf_dir(tmp_path, arch, tie, hf_tokenizer_dir)
    ck = load_checkpoint(d)
    assert_config_matches(ck.config, model.config, arch)
    assert ck.config.attention_bias == (arch == "qwen2")
    assert_weights_equal(ck.weights, model.state_dict())
    if tie:
        assert ck.weights["lm_head.weight"] is ck.weights["model.embed_tokens.weight"]
    assert isinstance(ck.tokenizer, HFTokenizer) and ck.tokenizer.encode("Hi there")[0] == 1
    assert len(ck.fingerprint) == 32


def test_inspect_checkpoint_agrees_with_load_without_weights(stories: Checkpoint, tmp_path: Path,
                                                            hf_tokenizer_dir: Path) -> None:
    d, _ = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir, max_shard_size="100KB")
    for path, loaded in ((stories.source, stories), (d, load_checkpoint(d))):
        info = loader.inspect_checkpoint(path)
        assert (info.config, info.fingerprint, info.source) == (loaded.config, loaded.fingerprint, loaded.source)
        assert info.tokenizer.encode("Once upon a time") == loaded.tokenizer.encode("Once upon a time")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        loader.inspect_checkpoint(tmp_path / "missing.gguf")


def test_hf_sharded_directory(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    d, model = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 1
    ck = load_checkpoint(d, dtype=torch.float16)
    assert_weights_equal(ck.weights, {k: v.half() for k, v in model.state_dict().items()})


def test_hf_fingerprint_sees_weight_changes(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    d, _ = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir)
    before = load_checkpoint(d).fingerprint
    assert load_checkpoint(d).fingerprint == before
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert load_checkpoint(d).fingerprint != before


# --- errors -----------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nope\.gguf: no such file or directory"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_checkpoint(tmp_path)


def test_truncated_safetensors(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    d, _ = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated safetensors file") as e:
        load_checkpoint(d)
    assert "\n" not in str(e.value)


def test_missing_tensor(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    d, _ = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"llama-untied: missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(d)


def test_unsupported_rope_scaling(tmp_path: Path, hf_tokenizer_dir: Path) -> None:
    d, _ = make_hf_dir(tmp_path, "llama", False, hf_tokenizer_dir)
    cfg = (d / "config.json").read_text().replace('"rope_type": "default"', '"rope_type": "linear", "factor": 2.0')
    (d / "config.json").write_text(cfg)
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported RoPE scaling 'linear'"):
        load_checkpoint(d)


# --- resolve_model_path -----------------------------------------------------------------------


def test_resolve_model_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    assert resolve_model_path("some/dir") == Path("some/dir")
    monkeypatch.setenv("PDSERVE_MODEL", "/models/x.gguf")
    assert resolve_model_path(None) == Path("/models/x.gguf")
    assert resolve_model_path("flag.gguf") == Path("flag.gguf")  # the flag wins over the environment
    monkeypatch.delenv("PDSERVE_MODEL")
    assert resolve_model_path(None) == GGUF.resolve()


def test_resolve_model_path_default_from_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    monkeypatch.setattr(loader, "REPO_ROOT", tmp_path / "elsewhere")
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    with pytest.raises(ModelLoadError, match="no model given: pass --model PATH or set PDSERVE_MODEL"):
        resolve_model_path(None)
    model = tmp_path / "shared/models/stories260K/stories260K.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"")
    assert resolve_model_path(None) == model.resolve()
