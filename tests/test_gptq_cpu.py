"""GPTQ checkpoints on the CPU's int4 kernel (pdserve.quant.gptq_cpu): the codes converted exactly
(against QuantizedWeight.dequantize), the kernel's matmul against QuantLinear's, act-order's input
permutation (fused parts, the kept dense copy), layouts the kernel cannot take, and an engine on a
GPTQ act-order checkpoint made by `pdserve quantize` against the same checkpoint on QuantLinear."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import STORIES_GGUF, random_hf_model
from pdserve.cli import build_parser
from pdserve.quant.checkpoint import write_gguf_tokenizer
from pdserve.quant.gptq_cpu import int4_codes, layout_problem
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.int4_cpu import Int4Linear, permute_columns
from pdserve.quant.int4_codes import weights_for
from pdserve.runtime.kernels import cpu_int4_matmul
from pdserve.quant.linear import ConcatLinear, QuantLinear, fused_linear
from pdserve.quant.quantizer import QuantResult, rtn_quantize
from pdserve.quant.spec import QuantSpec
from pdserve.runtime.config import CacheConfig, ConfigError, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams

BF16 = torch.bfloat16


def gptq_weight(out: int, n: int, bits: int, group: int, sym: bool, act_order: bool, seed: int = 0,
                order: torch.Tensor | None = None) -> QuantizedWeight:
    """A GPTQ-format weight of random values, its groups over the inputs in `order` (act-order: a
    random permutation, unless given) as AutoGPTQ forms them; scales in bf16, as a bf16 load holds them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=gen) * 0.05
    if order is None:
        order = torch.randperm(n, generator=gen) if act_order else torch.arange(n)
    res = rtn_quantize(w[:, order], QuantSpec(bits, group, sym=sym))
    codes = torch.empty_like(res.codes)
    codes[:, order] = res.codes
    g_idx = torch.empty(n, dtype=torch.int32)
    g_idx[order] = res.g_idx
    qw = QuantizedWeight.from_result(QuantResult(codes, res.scales, res.zeros, g_idx), bits)
    return replace(qw, scales=qw.scales.to(BF16))


def reference(w: QuantizedWeight) -> torch.Tensor:
    """[out, in] fp32: the checkpoint's (q - z) * s with s as the bf16 load rounded it."""
    g = w.g_idx.long()
    return (w.codes() - w.zeros()[g].t()).float() * w.scales.float()[g].t()


LAYOUTS = [(4, 32, True, False), (4, 32, False, False), (4, 128, False, False), (4, 128, True, True),
           (4, 128, False, True), (4, 32, False, True), (4, -1, False, False), (8, -1, True, False),
           (8, 32, False, True)]


@pytest.mark.parametrize("bits,group,sym,act_order", LAYOUTS)
def test_codes_convert_exactly_and_the_kernel_rounds_within_bf16_error(bits, group, sym, act_order):
    w = gptq_weight(96, 256, bits, group, sym, act_order)
    assert layout_problem(w) is None
    codes = int4_codes(w, BF16)
    assert (codes.perm is not None) == act_order
    # Before the kernel's rounding to bf16 the conversion is exact: (q - 8) s + (8 - z) s = (q - z) s.
    assert torch.equal(codes.dequantize(), reference(w))
    # The kernel's weight, its zero and the weight itself rounded to bf16: within
    # (|q - z| + |8 - z|) s 2^-8 of the checkpoint's (the scale is bf16 already, as loaded).
    lin = Int4Linear(codes)
    g = w.g_idx.long()
    z, s = w.zeros()[g].t().float(), w.scales.float()[g].t()  # [out, in]
    mid = 8 if bits == 4 else 136
    bound = ((w.codes() - z).abs() + (mid - z).abs()) * s * 2 ** -8
    perm = codes.perm if act_order else torch.arange(256)
    assert ((lin.dequantized().float() - reference(w)[:, perm]).abs() <= bound[:, perm] + 1e-9).all()
    if sym and bits == 4:  # zero 0: exactly the checkpoint's weight rounded to bf16
        assert torch.equal(lin.dequantized(), reference(w)[:, perm].to(BF16))


@pytest.mark.parametrize("rows", [1, 7, 200])  # 200: past DENSE_FROM_ROWS, dequantized then dense
@pytest.mark.parametrize("bits,group,sym,act_order", [(4, 128, False, True), (4, 32, True, False), (8, 32, False, True)])
def test_int4_linear_equals_quant_linear_within_bf16_error(bits, group, sym, act_order, rows):
    w = gptq_weight(96, 256, bits, group, sym, act_order, seed=rows)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(1)).to(BF16)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2)).to(BF16)
    want = F.linear(x.float(), reference(w), bias.float())  # fp32
    got, dense = Int4Linear(int4_codes(w, BF16), bias)(x).float(), QuantLinear.of([w], bias)(x).float()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2 ** -6 * scale  # a few bf16 ulps of the largest output
    assert (got - dense).abs().max() <= 2 ** -6 * scale


def test_fused_act_order_parts_share_one_permutation():
    order = torch.randperm(128, generator=torch.Generator().manual_seed(5))
    q, k, v = (gptq_weight(o, 128, 4, 32, False, True, seed=o, order=order) for o in (64, 32, 32))
    fused = fused_linear([int4_codes(p, BF16) for p in (q, k, v)])
    assert isinstance(fused, Int4Linear) and fused.perm is not None
    x = torch.randn(5, 128).to(BF16)
    separate = torch.cat([Int4Linear(int4_codes(p, BF16))(x) for p in (q, k, v)], dim=-1)
    assert torch.equal(fused(x), separate)
    other = gptq_weight(32, 128, 4, 32, False, True, seed=9)  # its own activation order
    assert isinstance(fused_linear([int4_codes(q, BF16), int4_codes(other, BF16)]), ConcatLinear)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_kept_dense_copy_of_a_permuted_weight_changes_no_output_bit(bits):
    codes = int4_codes(gptq_weight(128, 128, bits, 64, False, True), BF16)
    plain, kept = Int4Linear(codes), Int4Linear(codes)
    kept.keep_dense_copy()
    gen = torch.Generator().manual_seed(3)
    # Rows that take the same path with the copy and without: the same bits (between the two
    # thresholds the copy runs dense, tested in test_int4_cpu.py).
    for rows in (1, kept.dense_from_rows - 1, plain.dense_from_rows, 300):
        x = torch.randn(rows, 128, generator=gen).to(BF16)
        assert torch.equal(kept(x), plain(x)), rows
    x = torch.randn(kept.dense_from_rows, 128, generator=gen).to(BF16)
    assert torch.equal(kept(x), F.linear(permute_columns(x, kept.perm), plain.dequantized()))
    x = torch.randn(300, 128, generator=gen).to(BF16)
    torch.testing.assert_close(kept(x).float(), x.float() @ codes.dequantize().t(), rtol=0.02, atol=0.05)


def test_layouts_the_kernel_cannot_take_are_named():
    assert layout_problem(gptq_weight(16, 192, 4, 48, False, False)) == "groups not whole runs of 32 inputs"
    assert layout_problem(gptq_weight(16, 172, 4, 32, False, False)) == "172 inputs, not a multiple of 32"
    assert layout_problem(gptq_weight(172, 64, 4, 32, False, False)) == "172 outputs, not a multiple of 16"


# ---- checkpoints made by `pdserve quantize` ---------------------------------------------------

def quantize(model, out, *flags: str) -> None:
    args = build_parser().parse_args(["quantize", "--model", str(model), "--out", str(out), *flags])
    assert args._run(args) == 0


def engine(checkpoint, weight_format: str, dense_copy: bool = False) -> Engine:
    return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64, dtype="bfloat16"),
                                                           dtype="bfloat16", weight_format=weight_format,
                                                           dense_copy=dense_copy))


@pytest.fixture(scope="module")
def act_order_dir(tmp_path_factory):
    """GPTQ INT4 g128 act-order of a random llama whose dims are multiples of 128 (stories260K's
    MLP width, 172, fits neither the kernel's groups nor its rows), calibrated on stories260k text
    (its tokenizer). Eight tokens' output rows are scaled up so that greedy picks among them by
    clear margins: a random model's top two logits are otherwise often one bf16 ulp apart, a tie
    that any rounding difference breaks either way."""
    src, out = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("gptq")
    model = random_hf_model("llama", seed=13, vocab_size=512, hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2)
    with torch.no_grad():
        model.lm_head.weight[:8] *= 16
    model.save_pretrained(src)
    write_gguf_tokenizer(STORIES_GGUF, src / "tokenizer.gguf")
    quantize(src, out, "--method", "gptq", "--bits", "4", "--group-size", "128", "--desc-act",
             "--calib", "stories260k", "--calib-samples", "8", "--calib-seq-len", "32", "--threads", "1")
    return out


PROMPTS = [[1, 72, 301, 45, 9, 388], [1, 5, 17], [1, 400, 12, 250, 31, 77, 102, 6, 90]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_act_order_checkpoint_on_int4_follows_quant_linear(act_order_dir):
    from pdserve.commands.quant_eval import sequence_logits
    from pdserve.runtime.model import LlamaModel

    ck = load_checkpoint(act_order_dir, dtype=BF16)
    w = ck.weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, QuantizedWeight) and not torch.equal(w.g_idx, torch.sort(w.g_idx).values)  # act-order
    # The packed engine as a worker's (the dense copy: prompt rows exact on it whatever their count, so
    # that batched = unbatched below holds to the bit; without it a 3-token prompt took int8 inputs)
    packed, dense = engine(ck, "int4", dense_copy=True), engine(ck, "dense")
    assert packed.weight_format == "int4" and isinstance(packed.runner.model.layers[0].qkv, Int4Linear)
    assert isinstance(dense.runner.model.layers[0].qkv, QuantLinear)
    assert engine(ck, "auto").weight_format == "int4"  # auto takes the checkpoint's 4-bit codes in bf16
    want = [s.output_ids for s in dense.generate(PROMPTS, GREEDY)]
    int4_weights = weights_for(ck, EngineConfig(dtype="bfloat16", weight_format="int4"))[0]
    alone = [_free_running(packed, p) for p in PROMPTS]
    decisive = 0
    for prompt, out, (got, got_logits) in zip(PROMPTS, want, alone):  # teacher-forced on QuantLinear's path
        ids, steps = prompt + out, slice(len(prompt) - 1, -1)
        a = sequence_logits(LlamaModel(ck.config, ck.weights), ids, kv_dtype="bfloat16").float()[steps]
        b = sequence_logits(LlamaModel(ck.config, int4_weights), ids, kv_dtype="bfloat16").float()[steps]
        diff = (a - b).abs().max()
        assert diff <= 2 ** -5 * a.abs().max()  # rounding, not a wrong permutation
        # Where the top-2 margin exceeds twice the largest rounding difference, rounding cannot
        # flip the token (bf16 kernels round differently per CPU: AVX2 and AVX-512 differ here).
        top2 = a.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * diff  # [steps]
        assert torch.equal(b.argmax(-1)[sure], a.argmax(-1)[sure])
        decisive += int(sure.sum())
        # Free-running, the engine's decode steps take int8 inputs (the few-row kernel), which b's
        # teacher-forced rows do not: its tokens follow QuantLinear's until a position whose margin is
        # under twice the difference of the engine's own logits there (on the same prefix up to then).
        agree = next((i for i, (g, o) in enumerate(zip(got, out)) if g != o), len(out))
        if agree < len(out):
            own = (got_logits[:agree + 1] - a[:agree + 1]).abs().max()
            assert own <= 2 ** -4 * a.abs().max()  # int8 inputs' rounding, not a wrong permutation
            assert top2[agree, 0] - top2[agree, 1] <= 2 * max(diff, own), (agree, got, out)
    assert decisive >= 0.75 * sum(len(o) for o in want), "near-ties on most of the path: the test is moot"
    assert [s.output_ids for s in packed.generate(PROMPTS, GREEDY)] == [g for g, _ in alone]  # batched = unbatched


def _free_running(eng: Engine, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """A greedy request alone: its tokens and the logits each was taken from ([steps, V] fp32)."""
    eng.keep_logits = True
    eng.add_request("alone", prompt, GREEDY)
    tokens, logits = [], []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
        logits.append(eng.last_logits[-1].float().clone())
    eng.keep_logits = False
    return tokens, torch.stack(logits)



def test_down_permutation_folded_into_gate_and_up_rows_changes_no_output_bit(act_order_dir):
    ck = load_checkpoint(act_order_dir, dtype=BF16)
    folded = weights_for(ck, EngineConfig(dtype="bfloat16", weight_format="int4"))[0]
    names = [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    plain = [int4_codes(ck.weights[n], BF16) for n in names]
    assert plain[2].perm is not None and folded[names[2]].perm is None  # the gather is gone
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(4)).to(BF16)

    def mlp(gate, up, down) -> torch.Tensor:
        h = fused_linear([gate, up])(x)  # [7, 2 I]
        return Int4Linear(down)(F.silu(h[:, :256]) * h[:, 256:])

    assert torch.equal(mlp(*(folded[n] for n in names)), mlp(*plain))


@pytest.fixture(scope="module")
def stories_g32_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("stories-g32")
    quantize(STORIES_GGUF, out, "--method", "rtn", "--bits", "4", "--group-size", "32")
    return out


def test_inputs_not_a_multiple_of_32_stay_on_quant_linear_or_refuse_int4(stories_g32_dir, caplog):
    """stories260K's MLP is 172 wide (gate/up outputs, down inputs): under auto it stays on
    QuantLinear (one log line) and attention runs the kernel; --weight-format int4 refuses it in one line."""
    ck = load_checkpoint(stories_g32_dir, dtype=BF16)
    with caplog.at_level(logging.INFO, logger="pdserve.quant.gptq_cpu"):
        e = engine(ck, "auto")
    assert e.weight_format == "packed"
    layer = e.runner.model.layers[0]
    assert isinstance(layer.qkv, Int4Linear) and isinstance(layer.o, Int4Linear)
    assert isinstance(layer.gate_up, QuantLinear) and isinstance(layer.down, QuantLinear)
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.quant.gptq_cpu"]
    assert lines == ["weight format packed: 15 of 35 GPTQ projections stay as loaded, not the int4 kernel's codes "
                     "as they are (172 inputs, not a multiple of 32; 172 outputs, not a multiple of 16)"]
    with pytest.raises(ConfigError, match=r"^--weight-format int4: model.layers.0.mlp.gate_proj.weight has 172 "
                                          r"outputs, not a multiple of 16: serve it with --weight-format auto or dense$"):
        weights_for(ck, EngineConfig(dtype="bfloat16", weight_format="int4"))
    assert weights_for(ck, EngineConfig(dtype="float32", weight_format="auto"))[1] == "dense"  # fp32: QuantLinear


def test_fp32_int4_linear_of_gptq_codes_is_within_the_kernels_quantization_bound():
    """fp32 runs our C kernel, which reads whole rows of code bytes: a GPTQ checkpoint's codes come
    as a transposed view, and their packing must still be row-contiguous (it was not: garbage out)."""
    w = gptq_weight(96, 256, 4, 32, True, False, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    lin = Int4Linear(int4_codes(w, torch.float32))
    got, want = lin(x).double(), x.double() @ reference(w).double().t()
    bound = cpu_int4_matmul.error_bound(x, lin.codes_f32(), lin.q8.scale, lin.q8.mins).double()
    assert ((got - want).abs() <= bound + 1e-5 * want.abs().max()).all()
