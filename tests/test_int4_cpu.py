"""4-bit packed weights on the CPU (pdserve.quant.int4_cpu): the GGUF's own Q4 codes read exactly
(against the gguf package's dequantizer), the packed matmul against the dense matmul of the same
dequantized weight, and an engine on SmolLM2's Q4_1 codes against the dense bf16 engine."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize, quantize

from conftest import STORIES_GGUF
from pdserve.quant.int4_cpu import (DENSE_COPY_FROM_ROWS, DENSE_COPY_FROM_ROWS_TWO_PLANES, DENSE_PACKED_FROM_ROWS,
                                    Int4Linear, linear_packed, onednn_packed)
from pdserve.quant.int4_codes import codes_of_gguf_blocks, quantize_rtn, weights_for
from pdserve.runtime.config import CacheConfig, ConfigError, EngineConfig
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams

Q4 = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_codes_of_gguf_blocks_dequantize_exactly_as_gguf_does(qtype):
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, qtype)
    codes = codes_of_gguf_blocks(raw, int(qtype), (48, 96))
    assert codes.codes.dtype == torch.uint8 and int(codes.codes.max()) <= 15
    assert torch.equal(codes.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


def test_other_types_have_no_codes():
    raw = quantize(np.ones((4, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    assert codes_of_gguf_blocks(raw, int(gguf.GGMLQuantizationType.Q8_0), (4, 32)) is None


def test_rtn_keeps_each_groups_extremes_and_stays_within_half_a_step():
    w = torch.randn(16, 64)
    codes = quantize_rtn(w)
    groups = w.view(16, 2, 32)
    err = (codes.dequantize().view(16, 2, 32) - groups).abs()
    assert (err <= codes.scale[..., None] / 2 + 1e-6).all()
    back = codes.dequantize().view(16, 2, 32)
    assert torch.allclose(back.amin(-1), groups.amin(-1), atol=1e-5)
    assert torch.allclose(back.amax(-1), groups.amax(-1), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 32, 256])  # 256: past DENSE_FROM_ROWS, dequantized then dense
def test_packed_matmul_equals_the_dense_matmul_of_the_dequantized_weight(rows):
    gen = torch.Generator().manual_seed(rows)
    q, k = quantize_rtn(torch.randn(96, 64, generator=gen)), quantize_rtn(torch.randn(32, 64, generator=gen))
    bias = torch.randn(128, generator=gen)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    fused = Int4Linear.fused([q, k], bias)
    want = F.linear(x.float(), torch.cat([q.dequantize(), k.dequantize()]), bias)  # fp32 reference
    got = fused(x).float()
    # bf16 output and bf16 scales: within a few bf16 ulps of the largest output
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()
    assert torch.equal(fused(x)[:, :96], Int4Linear(q, bias[:96])(x))  # fused = separate, bit for bit
    # torch's packing with bf16 scales and zeros, and our kernel's (Q8Form, for steps of few rows) with
    # fp32 scales and mins: 1.375 bytes a weight against bf16's 2 (and the biases)
    assert fused.nbytes < 0.75 * 128 * 64 * 2


def test_both_paths_dequantize_to_the_same_weight():
    codes = quantize_rtn(torch.randn(64, 96))
    lin = Int4Linear(codes)
    eye = torch.eye(96).bfloat16()
    # torch's packing (lin keeps none where the AMX kernel runs: tests/test_cpu_int4_amx.py checks that one)
    packed = lin.packed if lin.packed is not None else torch._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 1)
    via_kernel = torch._weight_int4pack_mm_for_cpu(eye, packed, 32, lin.scales_and_zeros).t()  # [64, 96]
    assert torch.equal(lin.dequantized(), via_kernel)  # the kernel's weight is ours, bit for bit
    assert (lin.dequantized().float() - codes.dequantize()).abs().max() <= 2 ** -7 * codes.dequantize().abs().max()


@pytest.mark.parametrize("planes", [1, 2])
def test_a_kept_dense_copy_changes_no_output_bit_that_both_compute_alike(planes):
    """keep_dense_copy caches what each many-row call dequantizes: every call that takes the same path
    with it and without (the kernel below the copy's threshold, dense from the plain one's) gives the
    same bits. Between the two thresholds (bf16 decode steps of many sequences) the copy runs the
    dense matmul of the very weights the plain linear's kernel multiplies: equal within bf16 rounding."""
    gen = torch.Generator().manual_seed(planes)
    codes = quantize_rtn(torch.randn(128, 64, generator=gen))
    if planes == 2:  # an 8-bit weight as two planes: high scales 16x the low ones, high zero 0
        codes = type(codes)(torch.cat([codes.codes, codes.codes.flip(1)], dim=1),
                            torch.cat([16 * codes.scale, codes.scale], dim=1),
                            torch.cat([torch.zeros_like(codes.zero), codes.zero], dim=1), planes=2)
    plain, kept = Int4Linear(codes), Int4Linear(codes)
    kept.keep_dense_copy()
    assert kept.nbytes >= plain.nbytes + 128 * 64 * 2  # the copy is the bf16 weight (oneDNN's layout may pad it)
    threshold = DENSE_COPY_FROM_ROWS if planes == 1 else DENSE_COPY_FROM_ROWS_TWO_PLANES
    assert kept.dense_from_rows == (min(threshold, DENSE_PACKED_FROM_ROWS) if kept.dense_packed else threshold)
    # With the VNNI GEMM (tests/test_cpu_q8_gemm.py) the copy takes rows of no told kind from 5 on.
    first_dense = kept.dense_from_rows if kept.q8_gemm is None else cpu_int4_matmul.BF16_Q8_BELOW_ROWS
    for rows in (1, first_dense - 1, plain.dense_from_rows, 300):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        assert torch.equal(kept(x), plain(x)), rows
    for rows in (first_dense, plain.dense_from_rows - 1):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        assert torch.equal(kept(x), F.linear(x, plain.dequantized()))
        # Two bf16 roundings of the output (2^-9 of |x| |w| each) and the kernel's own weight rounding.
        bound = (x.double().abs() @ plain.dequantized().double().abs().t()) * 2 ** -7
        assert ((kept(x).double() - plain(x).double()).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_a_prompt_chunk_of_any_size_takes_the_kept_copys_exact_products(rows):
    """In a forward that says its rows are all prompt tokens, a kept copy takes them however few: a
    prompt's 1-4-token chunk (a short prompt, a chunked one's tail, the rest after a cached prefix) took
    the few-row kernel's int8 inputs before, so its arithmetic depended on how the prompts were cut."""
    from pdserve.quant import int4_cpu

    gen = torch.Generator().manual_seed(rows)
    kept = Int4Linear(quantize_rtn(torch.randn(64, 96, generator=gen)))
    kept.keep_dense_copy()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    with int4_cpu.token_kinds(int4_cpu.RowKinds.of(torch.zeros(rows, dtype=torch.bool))):
        got = kept(x)
    assert torch.equal(got, F.linear(x, kept.dequantized()))
    if rows < cpu_int4_matmul.BF16_Q8_BELOW_ROWS:  # untold rows, as before: the few-row kernel
        assert torch.equal(kept(x), cpu_int4_matmul.matmul_bf16(x, kept.q8.nibbles, kept.q8.scale, kept.q8.mins,
                                                                kept.q8.bias))


def test_int4_runs_on_the_cpu_only():
    with pytest.raises(ConfigError, match="--weight-format int4 runs on the CPU, not on cuda"):
        EngineConfig(weight_format="int4", dtype="bfloat16", device="cuda")
    assert EngineConfig(weight_format="auto", dtype="float32").weight_format == "auto"  # auto never refuses


# ---- SmolLM2-135M-Instruct (its projections are Q4_1 in the GGUF) ------------------------------


def _engine(checkpoint, weight_format: str) -> Engine:
    return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64, dtype="bfloat16"),
                                                           dtype="bfloat16", weight_format=weight_format))


def test_auto_takes_the_files_codes_in_bf16_with_exact_inputs_in_fp32_and_dense_on_a_gpu(smollm2_bf16):
    assert _engine(smollm2_bf16, "auto").weight_format == "int4"
    config = EngineConfig(cache=CacheConfig(num_blocks=8), dtype="bfloat16", weight_format="auto", device="cuda")
    assert weights_for(smollm2_bf16, config)[1] == "dense"
    config = EngineConfig(cache=CacheConfig(num_blocks=8), dtype="float32", weight_format="auto")
    # fp32: the codes times unquantized inputs (int4's int8 inputs only when asked for)
    assert weights_for(smollm2_bf16, config)[1] == ("int4-exact" if cpu_int4_matmul.available() else "dense")
    from pdserve.runtime.loader import load_checkpoint

    stories = load_checkpoint(STORIES_GGUF, dtype=torch.bfloat16)  # float32 tensors in the file: no codes
    assert weights_for(stories, EngineConfig(dtype="bfloat16", weight_format="auto"))[1] == "dense"


def test_int4_model_follows_the_dense_model_on_the_same_codes(smollm2_bf16):
    """The packed model runs the file's Q4_1 codes; the dense one the same codes dequantized to bf16.
    Their only difference is rounding (bf16 weights vs bf16 scales): teacher-forced over a chat
    answer they pick the same next token almost everywhere, and the greedy answer starts alike."""
    from pdserve.commands.quant_eval import kl_and_top1, sequence_logits
    from pdserve.runtime.model import LlamaModel

    ck = smollm2_bf16
    ids = ck.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome. Water boils at 100 "
                              "degrees Celsius at sea level, and the largest planet in our solar system is")
    config = EngineConfig(cache=CacheConfig(num_blocks=64, dtype="bfloat16"), dtype="bfloat16", weight_format="int4")
    dense = sequence_logits(LlamaModel(ck.config, ck.weights), ids, kv_dtype="bfloat16")
    packed = sequence_logits(LlamaModel(ck.config, weights_for(ck, config)[0]), ids, kv_dtype="bfloat16")
    kl, top1 = kl_and_top1([dense], [packed])
    assert top1 >= 0.9 and kl < 0.05, (top1, kl)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # Two tokens: the third is a near tie in both (378 against 2 within one bf16 step of the logits,
    # 12.44 / 12.38 packed), which any change of a bf16 rounding upstream may flip.
    assert _engine(ck, "int4").generate([ids], greedy)[0].output_ids[:2] == \
        _engine(ck, "dense").generate([ids], greedy)[0].output_ids[:2]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int4_batched_equals_unbatched(request, dtype):
    """A worker's engine (the dense copy: prompt rows on it, generated ones on our kernels) in bf16, and fp32
    (prompt rows dense, generated ones on our kernel): each prompt alone, then the three in one batch.
    Without the dense copy bf16 projections pick their kernel by row count (int8 inputs below 5 rows,
    torch's int4 kernel, then the dequantized weight), so there a prompt's tokens agree with its batched
    self only to rounding: a 4-token prompt alone took int8 inputs, batched the exact products."""
    checkpoint = request.getfixturevalue("smollm2_bf16" if dtype == "bfloat16" else "smollm2")
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64, dtype=dtype),
                                                             dtype=dtype, weight_format="int4",
                                                             dense_copy=dtype == "bfloat16"))
    tok = checkpoint.tokenizer
    prompts = [tok.encode(p) for p in ("Write a haiku about the sea.", "What is 2 + 2?", "Name three colours:")]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [engine.generate([p], greedy)[0].output_ids for p in prompts]
    assert [s.output_ids for s in engine.generate(prompts, greedy)] == alone


def test_a_dense_prefill_copy_leaves_the_engine_exact(smollm2_bf16):
    """A prefill worker's default (--dense-copy auto): a prompt chunk of more than
    DENSE_FROM_ROWS tokens runs on the kept copy; logits equal the engine without it, bit for bit."""
    ids = smollm2_bf16.tokenizer.encode("Summarise: " + "the sea is calm and the ships are in the harbour. " * 14)
    assert len(ids) > 160
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    logits = []
    for copy in (False, True):
        engine = Engine.from_checkpoint(smollm2_bf16, EngineConfig(
            cache=CacheConfig(num_blocks=64, dtype="bfloat16"), dtype="bfloat16", weight_format="int4",
            dense_copy=copy))
        engine.keep_logits = True
        engine.add_request("r", ids, greedy)
        engine.step()  # the whole prompt in one chunk
        logits.append(engine.last_logits.clone())
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(onednn_packed(torch.zeros(16, 32, dtype=torch.bfloat16)) is None, reason="torch without oneDNN")
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (3072, 576), (576, 1536), (49152 // 64, 576)])
def test_the_onednn_packed_weight_gives_f_linears_bits(out_features, in_features):
    """The kept copy in oneDNN's layout runs the kernel F.linear runs on the plain weight, without its
    per-call re-layout: the same bits at every row count, one thread or two, with a bias or not."""
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    packed = onednn_packed(w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 7, 8, 32, 33, 200):
                x = torch.randn(rows, in_features, generator=gen).bfloat16()
                assert torch.equal(linear_packed(x, packed, None), F.linear(x, w)), (threads, rows)
                assert torch.equal(linear_packed(x, packed, bias), F.linear(x, w, bias)), (threads, rows)
    finally:
        torch.set_num_threads(before)
