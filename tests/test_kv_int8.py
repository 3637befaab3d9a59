"""INT8 / FP8 KV cache: quantization error bounds, the wire format, format mismatches refused, and
greedy agreement with the FP32 cache on stories260K.

Agreement targets (measured on this CPU, torch 2.13, 12 prompts x 64 greedy tokens = 768 positions):
INT8 KV (one scale per block of 16 tokens and head) keeps 98.4% of FP32's teacher-forced top-1
choices and 97.4% along its own greedy decode (which rescales tail blocks token by token); FP8
e4m3 95.1%. bf16 KV reaches 99.7%, so this is the format, not a bug: stories260K's head dim is 8
with key magnitudes up to ~24 beside dims of ~2.6, so one scale per head and block is coarse for the
small dims. The asserts sit one point below the measurements (8 positions of 768): a regression in
the write/requantize or read path costs far more than that (a wrong scale is ~50% disagreement).
"""

from __future__ import annotations

import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.commands.quant_eval import PROMPTS, kl_and_top1, sequence_logits
from pdserve.kvwire import KVBlockError, KVFormatMismatch, decode_block, encode_block, read_header
from pdserve.runtime.config import CacheConfig, ConfigError, EngineConfig, ModelConfig
from pdserve.runtime.engine import AddRequest, Engine
from pdserve.runtime.kernels import kv_quant
from pdserve.runtime.kv_cache import allocate_kv_cache, kv_bytes_per_token
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.kv_transfer import KVFormatError
from pdserve.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TINY = ModelConfig("llama", 100, 32, 64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def checkpoint():
    from pdserve.runtime.loader import load_checkpoint

    return load_checkpoint(STORIES_GGUF)  # the repository's fixture: a missing model fails, never skips


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    return [checkpoint.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """The FP32-KV model, the prompts extended by its greedy continuation, and its logits on them."""
    engine = _engine(checkpoint, "float32", 128)
    seqs = [p + s.output_ids for p, s in zip(prompts, engine.generate(prompts, GREEDY))]
    return engine.runner.model, seqs, [sequence_logits(engine.runner.model, s) for s in seqs]


def _engine(checkpoint, kv_dtype: str, num_blocks: int = 256) -> Engine:
    return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=num_blocks, dtype=kv_dtype)))


def _cache(kv_dtype: str, num_blocks: int = 4, block_size: int = 8) -> torch.Tensor:
    return allocate_kv_cache(TINY, CacheConfig(block_size=block_size, num_blocks=num_blocks, dtype=kv_dtype), "cpu")


def _read(cache: torch.Tensor, layer: int, kind: int, slots: torch.Tensor) -> torch.Tensor:
    values = kv_quant.dequantize_slabs(cache[:, layer, kind])  # [NB, bs, KVH, D]
    return values.reshape(-1, *values.shape[2:])[slots]


# ---- error bounds -------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_one_write_round_trip_within_format_bound(kv_dtype: str) -> None:
    cache = _cache(kv_dtype)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(16, 2, 8, generator=gen) * 5, torch.randn(16, 2, 8, generator=gen)
    slots = torch.arange(8, 24)  # blocks 1 and 2, whole
    kv_quant.write_kv(cache, 1, k, v, slots)
    scales = kv_quant.scales_view(cache)[1:3, 1]  # [2 blocks, 2 k/v, KVH]
    for kind, x in ((0, k), (1, v)):
        got = _read(cache, 1, kind, slots)
        step = scales[:, kind].repeat_interleave(8, dim=0)[:, :, None]  # [16, KVH, 1]
        if kv_dtype == "int8":  # round to nearest: half a step
            bound = step / 2 * (1 + 1e-5)
        else:  # e4m3: 3 mantissa bits -> 2^-4 relative, plus half the smallest subnormal (2^-9)
            bound = x.abs() / 16 + step * 2.0 ** -10
        assert ((got - x).abs() <= bound).all()
    assert torch.allclose(scales[:, 0].amax(-1), k.view(2, 8, 2, 8).abs().amax(dim=(1, 3)).amax(-1) /
                          (127 if kv_dtype == "int8" else 448))


def test_token_by_token_writes_rescale_the_block() -> None:
    """Decode writes one token at a time with a growing range: earlier tokens are requantized to the
    new scale, each rescale costing at most half a step of the final scale."""
    cache = _cache("int8")
    x = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(1)) * torch.arange(1, 9)[:, None, None]
    for t in range(8):
        kv_quant.write_kv(cache, 0, x[t:t + 1], x[t:t + 1], torch.tensor([16 + t]))
    final = kv_quant.scales_view(cache)[2, 0, 0]  # [KVH]
    assert torch.allclose(final, x.abs().amax(dim=(0, 2)) / 127)
    err = (_read(cache, 0, 0, torch.arange(16, 24)) - x).abs()
    assert (err <= final[None, :, None] / 2 * 8).all()  # at most 7 rescales + the final rounding
    assert err.mean() < final.mean() / 2  # and typically far less


def test_block_reuse_ignores_stale_scale() -> None:
    cache = _cache("int8")
    kv_quant.write_kv(cache, 0, torch.full((8, 2, 8), 100.0), torch.full((8, 2, 8), 100.0), torch.arange(8))
    small = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(2)) * 0.01
    kv_quant.write_kv(cache, 0, small, small, torch.arange(3))  # freed and reused: starts at offset 0
    assert (_read(cache, 0, 1, torch.arange(3)) - small).abs().max() <= small.abs().max() / 254 * 1.0001


def test_bad_config_refused() -> None:
    with pytest.raises(ConfigError, match="unknown KV cache dtype 'int4'"):
        CacheConfig(dtype="int4")
    odd = ModelConfig("llama", 100, 36, 64, num_layers=1, num_heads=6, num_kv_heads=2, head_dim=6)
    with pytest.raises(ConfigError, match="multiple of 4"):
        allocate_kv_cache(odd, CacheConfig(num_blocks=2, dtype="int8"), "cpu")


# ---- memory and wire ----------------------------------------------------------------------------

def test_kv_bytes_per_token_measured_from_tensors() -> None:
    fp32, int8, fp8 = (kv_bytes_per_token(_cache(d, block_size=16)) for d in ("float32", "int8", "fp8_e4m3"))
    assert fp32 == 2 * 2 * 2 * 8 * 4  # layers * k/v * KVH * D * 4 bytes
    assert int8 == fp8 == fp32 / 4 * 17 / 16  # a quarter, plus the scale row (1 of 17 rows)


@pytest.mark.parametrize(("kv_dtype", "code"), [("int8", 4), ("fp8_e4m3", 5)])
def test_wire_header_names_the_format(checkpoint, prompts, kv_dtype: str, code: int) -> None:
    engine = _engine(checkpoint, kv_dtype, num_blocks=16)
    engine.add_request("r", prompts[2], SamplingParams(max_tokens=1, temperature=0), hold_blocks=True)
    while engine.has_unfinished():
        engine.step()
    blocks = engine.export_held("r")
    engine.release_held("r")
    c = checkpoint.config
    spec = KVFormat(engine.fingerprint, engine.kv_cache.dtype, c.num_layers, c.num_kv_heads, c.head_dim, 16)
    data = encode_block(blocks[0].data, spec, blocks[0].num_tokens)
    header = read_header(data)
    assert header.dtype_code == code and header.block_size == 16
    assert header.payload_len == blocks[0].data.numel() == c.num_layers * 2 * 17 * c.num_kv_heads * c.head_dim
    decoded, n = decode_block(data, spec)
    assert n == blocks[0].num_tokens and torch.equal(decoded.view(torch.uint8), blocks[0].data.view(torch.uint8))
    fp32_spec = KVFormat(spec.fingerprint, torch.float32, *spec.shape[:1], c.num_kv_heads, c.head_dim, 16)
    with pytest.raises(KVFormatMismatch, match=f"KV format {kv_dtype} != float32"):
        decode_block(data, fp32_spec)
    assert issubclass(KVFormatMismatch, KVBlockError)  # callers that catch KVBlockError keep working


# ---- engines: transfer, mismatch, agreement -----------------------------------------------------

def _prefill(engine: Engine, prompt: list[int]) -> tuple[int, list[bytes], dict[bytes, torch.Tensor]]:
    engine.add_request("p", prompt, GREEDY, hold_blocks=True)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    blocks = engine.export_held("p")
    engine.release_held("p")
    return first, [b.hash for b in blocks], {b.hash: b.data for b in blocks}


def test_int8_blocks_transfer_exactly(checkpoint, prompts) -> None:
    """Prefill on one INT8 engine, decode on another: the same tokens as one INT8 engine doing both."""
    prompt = prompts[2] + prompts[4]  # 3 blocks and a tail
    expected = _engine(checkpoint, "int8", 32).generate([prompt], SHORT)[0].output_ids
    first, hashes, blocks = _prefill(_engine(checkpoint, "int8", 32), prompt)
    decoder = _engine(checkpoint, "int8", 32)
    seq = decoder.add(AddRequest("d", prompt, SHORT, blocks=blocks, first_token=first, prompt_hashes=hashes))
    while decoder.has_unfinished():
        decoder.step()
    assert seq.output_ids == expected
    assert decoder.stats.tokens_computed == SHORT.max_tokens - 1  # no prompt token recomputed


def test_decode_refuses_blocks_of_another_format(checkpoint, prompts) -> None:
    first, hashes, blocks = _prefill(_engine(checkpoint, "int8", 16), prompts[0])
    decoder = _engine(checkpoint, "float32", 16)
    with pytest.raises(KVFormatError, match="--kv-dtype int8 but this worker runs --kv-dtype float32"):
        decoder.add(AddRequest("d", prompts[0], GREEDY, blocks=blocks, first_token=first, prompt_hashes=hashes))
    assert decoder.block_manager.num_free_blocks == 16 and not decoder.has_unfinished()


@pytest.mark.parametrize(("kv_dtype", "target"), [("int8", 0.975), ("fp8_e4m3", 0.94)])
def test_teacher_forced_top1_vs_fp32(reference, kv_dtype: str, target: float) -> None:
    model, seqs, ref = reference
    kl, top1 = kl_and_top1(ref, [sequence_logits(model, s, kv_dtype=kv_dtype) for s in seqs])
    assert top1 >= target, f"{kv_dtype} KV top-1 agreement {top1:.4f} < {target}"
    assert kl < (0.005 if kv_dtype == "int8" else 0.02)  # measured 0.0019 / 0.0105


def test_int8_greedy_decode_agrees_with_fp32(checkpoint, prompts, reference) -> None:
    """Greedy decode on the INT8 cache; at each generated position FP32 (teacher-forced on the
    same tokens) must pick the same token at >= 96% of the 768 positions (measured 97.4%)."""
    ref_model = reference[0]
    seqs = _engine(checkpoint, "int8").generate(prompts, GREEDY)
    agree = total = 0
    for p, s in zip(prompts, seqs):
        picks = sequence_logits(ref_model, p + s.output_ids)[len(p) - 1:-1].argmax(-1)
        agree += (picks == torch.tensor(s.output_ids)).sum().item()
        total += len(s.output_ids)
    assert agree / total >= 0.96, f"INT8 KV greedy agreement {agree / total:.4f} < 0.96"


def test_format_error_is_invalid_argument_at_the_service_edge() -> None:
    from pdserve.grpc_server import _status_for
    from pdserve.worker_common import WORKER_ERROR_CODES

    code, message = _status_for(KVFormatError("KV blocks were made with --kv-dtype int8 ..."), WORKER_ERROR_CODES)
    assert code.name == "INVALID_ARGUMENT" and "--kv-dtype int8" in message


def test_stack_with_int8_kv_equals_in_process_int8_engine(checkpoint, prompts) -> None:
    """`pdserve up --kv-dtype int8`: prefill writes INT8 blocks (header code 4, scale row) to the
    kvstore, decode imports them; greedy output equals the in-process INT8 engine's."""
    from pdserve.kvwire import HEADER_SIZE
    from pdserve.stack import start_stack
    from pdserve.v1 import common_pb2, gateway_pb2

    engine = _engine(checkpoint, "int8")
    c = checkpoint.config
    block_bytes = HEADER_SIZE + c.num_layers * 2 * 17 * c.num_kv_heads * c.head_dim  # int8 codes + scale row
    stack = start_stack(1, 1, "--kv-dtype", "int8")
    try:
        stub = stack.gateway_stub()
        for text, ids in list(zip(PROMPTS, prompts))[:4]:
            chunks = list(stub.Generate(gateway_pb2.GenerateRequest(
                prompt=text, sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0))))
            got = [t for ch in chunks for t in ch.token_ids]
            assert got == engine.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0].output_ids, text
        sent = stack.worker_stats("prefill-0").kv_bytes_sent
        assert sent > 0 and sent % block_bytes == 0
        assert stack.worker_stats("decode-0").kv_bytes_received > 0
    finally:
        stack.stop()
