"""A GGUF's own Q8_0 / K-quant codes served packed (pdserve.quant.gguf_packed): the codes read exactly
(against gguf.quants.dequantize, the reference), the packed matmul against F.linear on the
dequantized weight, a random tiny Llama GGUF of mixed block types loaded packed against the dense
load of the same file, and malformed files refused in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from pdserve.quant.gguf_packed import int4_codes, parse_blocks, weights_for
from pdserve.quant.int4_cpu import Int4Linear
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.kernels.cpu_int4_matmul import BF16_Q8_BELOW_ROWS
from pdserve.runtime.loader import ModelLoadError, load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
# gguf quantizes these itself; it has no quantizer for K-quants, whose blocks are built from random bytes
QUANTIZABLE = {Q.Q8_0, Q.Q4_0, Q.Q4_1}
BLOCK = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # bytes per 256 weights


def k_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks [N, K / 256 * bytes]: every code and 6-bit scale/min byte random, the
    fp16 super-block scales d (and dmin) small and positive."""
    blocks = rng.integers(0, 256, (n, k // 256, BLOCK[qtype]), dtype=np.uint8)
    half = lambda: (rng.random((n, k // 256)) * 0.004 + 0.001).astype(np.float16).view(np.uint8).reshape(n, -1, 2)  # noqa: E731
    if qtype == Q.Q6_K:
        blocks[..., -2:] = half()  # ql, qh, 16 int8 scales, then d
    else:
        blocks[..., 0:2], blocks[..., 2:4] = half(), half()  # d, dmin, then scales and codes
    return blocks.reshape(n, -1)


def raw_of(qtype: Q, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return quantize(w, qtype) if qtype in QUANTIZABLE else k_blocks(qtype, *w.shape, rng)


PACKED = [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_parsed_codes_dequantize_exactly_as_gguf_does(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = raw_of(qtype, rng.standard_normal((32, 512)).astype(np.float32), rng)
    codes = parse_blocks(raw, int(qtype), (32, 512))
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) < 2 ** codes.bits
    assert torch.equal(codes.dequantize(), torch.from_numpy(dequantize(raw, qtype)))
    assert parse_blocks(k_blocks(Q.Q6_K, 4, 256, rng), int(Q.Q6_K), (4, 256)) is None  # served dense


@pytest.mark.parametrize("rows", [1, 5, 200])  # 200: past both crossovers, dequantized then dense
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q5_K], ids=lambda t: t.name)
def test_packed_matmul_equals_f_linear_on_the_dequantized_weight(qtype, rows):
    rng = np.random.default_rng(rows)
    raw = raw_of(qtype, rng.standard_normal((128, 512)).astype(np.float32), rng)
    w = torch.from_numpy(dequantize(raw, qtype))  # [128, 512] fp32: the reference weight
    lin = Int4Linear(int4_codes(parse_blocks(raw, int(qtype), (128, 512))).for_dtype(torch.bfloat16))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want, got = F.linear(x.float(), w), lin(x).float()
    # bf16 scales and a bf16 output: within a few bf16 ulps of the largest output; fewer rows than
    # BF16_Q8_BELOW_ROWS of one plane run our kernel, whose int8 inputs add their quantization's error
    q8 = lin.q8 is not None and rows < BF16_Q8_BELOW_ROWS
    quantized = cpu_int4_matmul.error_bound(x.float(), lin.codes_f32(), lin.q8.scale, lin.q8.mins) if q8 else 0
    assert ((got - want).abs() <= 2 ** -6 * want.abs().max() + quantized).all()
    # both paths (kernel, dequantized weight) multiply the same weight up to bf16 rounding
    assert (lin.dequantized().float() - w).abs().max() <= 2 ** -7 * w.abs().max()
    bits = 16 * lin.nbytes / (128 * 512 * 2)
    # torch's packing with bf16 scales and zeros; 4-bit codes also in our kernel's form, fp32 scales and mins
    assert bits <= (10.01 if qtype in (Q.Q8_0, Q.Q5_K) else 11.01), bits


def test_rows_not_a_multiple_of_the_kernels_blocks_keep_their_own_copy_and_agree():
    """80 output rows, not a multiple of the kernel's blocks (64 rows with AVX-512, 32 with AVX2): it
    packs the last ones differently, so the layer keeps a copy of its codes to dequantize from; both
    paths still multiply the file's weight."""
    rng = np.random.default_rng(7)
    raw = quantize(rng.standard_normal((80, 256)).astype(np.float32), Q.Q8_0)
    w = torch.from_numpy(dequantize(raw, Q.Q8_0))
    lin = Int4Linear(int4_codes(parse_blocks(raw, int(Q.Q8_0), (80, 256))).for_dtype(torch.bfloat16))
    assert lin.nibbles is not None
    for rows in (1, 200):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = F.linear(x.float(), w)
        assert (lin(x).float() - want).abs().max() <= 2 ** -6 * want.abs().max()


# ---- a random tiny Llama GGUF with packed projections -------------------------------------------

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=True)
MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_K,
         "ffn_up": Q.Q8_0, "ffn_down": Q.Q5_K}


def write_tiny(path: Path, types: dict[str, Q]) -> None:
    """A tiny Llama with random weights: projections of the types `types` gives their GGUF role,
    norms and the tied embedding float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_loader import _write_hparams

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    _write_hparams(w, model.config, "llama")
    w.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().numpy())
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    for layer in range(2):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(256, dtype=np.float32))
        for role, qtype in types.items():
            rows = {"attn_k": 128, "attn_v": 128, "ffn_gate": 512, "ffn_up": 512}.get(role, 256)
            cols = 512 if role == "ffn_down" else 256
            raw = raw_of(qtype, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), rng)
            w.add_tensor(f"blk.{layer}.{role}.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "mixed.gguf"
    write_tiny(path, MIXED)
    return load_checkpoint(path, dtype=torch.bfloat16)


def engine(checkpoint, weight_format: str) -> Engine:
    e = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=32, dtype="bfloat16"),
                                                        dtype="bfloat16", weight_format=weight_format))
    e.keep_logits = True
    return e


def greedy_with_logits(e: Engine, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    e.add_request("r", prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    tokens, logits = [], []
    while e.has_unfinished():
        out = e.step()
        logits.append(e.last_logits[0].float().clone())
        tokens += [t for o in out for t in o.new_token_ids]
    return tokens, logits


def test_mixed_gguf_loads_packed_and_follows_the_dense_load(mixed, caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.quant.gguf_packed"):
        packed = engine(mixed, "auto")
    assert packed.weight_format == "packed"
    assert "2 of 14 projections (Q6_K) are dequantized at load to bfloat16" in caplog.text  # v of 2 layers
    prompt = [1, 15, 300, 7, 42, 99, 511, 3]
    got, got_logits = greedy_with_logits(packed, prompt, 6)
    want, want_logits = greedy_with_logits(engine(mixed, "dense"), prompt, 6)
    for a, b in zip(got_logits, want_logits):  # bf16 scales vs bf16 weights: a few bf16 ulps apart
        assert (a - b).abs().max() <= 0.02 * b.abs().max()
    assert got == want


def test_auto_keeps_int4_for_q4_files_and_packs_q8_0(tmp_path):
    config = EngineConfig(dtype="bfloat16", weight_format="auto")
    write_tiny(tmp_path / "q8.gguf", {r: Q.Q8_0 for r in MIXED})
    assert weights_for(load_checkpoint(tmp_path / "q8.gguf", dtype=torch.bfloat16), config)[1] == "packed"
    write_tiny(tmp_path / "q4.gguf", {r: Q.Q4_1 for r in MIXED})
    assert weights_for(load_checkpoint(tmp_path / "q4.gguf", dtype=torch.bfloat16), config)[1] == "int4"
    fp32 = EngineConfig(dtype="float32", weight_format="auto")  # torch's kernel needs bf16/fp16
    assert weights_for(load_checkpoint(tmp_path / "q8.gguf"), fp32)[1] == "dense"
    # Q4 codes in fp32: our W4A32 kernel, where the library builds
    four = weights_for(load_checkpoint(tmp_path / "q4.gguf"), fp32)[1]
    assert four == ("int4-exact" if cpu_int4_matmul.available() else "dense")


# ---- malformed files ------------------------------------------------------------------------------


def _patch_tensor_info(path: Path, name: bytes, dim0: int | None = None, qtype: Q | None = None) -> None:
    """Rewrite a tensor's first dimension or type in the tensor-info table (name, n_dims u32, dims u64, type u32)."""
    raw = bytearray(path.read_bytes())
    start = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[start:start + 4], "little")
    if dim0 is not None:
        raw[start + 4:start + 12] = dim0.to_bytes(8, "little")
    if qtype is not None:
        at = start + 4 + 8 * n_dims
        raw[at:at + 4] = int(qtype).to_bytes(4, "little")
    path.write_bytes(raw)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("damage", ["row-not-whole-blocks", "type-of-other-block-size", "truncated"])
def test_malformed_packed_tensor_is_one_line(tmp_path, damage):
    path = tmp_path / "bad.gguf"
    write_tiny(path, {r: Q.Q8_0 for r in MIXED})
    if damage == "row-not-whole-blocks":
        _patch_tensor_info(path, b"blk.1.ffn_down.weight", dim0=500)  # 500 is not whole 32-weight blocks
    elif damage == "type-of-other-block-size":
        _patch_tensor_info(path, b"blk.1.ffn_down.weight", qtype=Q.Q4_K)
    else:
        path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: ") as e:
        ck = load_checkpoint(path, dtype=torch.bfloat16)
        weights_for(ck, EngineConfig(dtype="bfloat16", weight_format="auto"))
    assert "\n" not in str(e.value)
