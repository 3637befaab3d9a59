"""Weight quantization: packing, RTN/GPTQ error, GPTQ-format checkpoints (ours and hand-built
AutoGPTQ-style ones), fused projections, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import STORIES_GGUF, model_config_from_hf, random_hf_model
from pdserve.quant.checkpoint import write_gguf_tokenizer
from pdserve.quant.gptq import HessianAccumulator, gptq_quantize
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.linear import ConcatLinear, QuantLinear, fused_linear
from pdserve.quant.packing import pack_cols, pack_rows, unpack_cols, unpack_rows
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import QuantError, QuantSpec, check_quantize_request
from pdserve.runtime.loader import ModelLoadError, load_checkpoint

SPECS = [QuantSpec(8, -1, sym=True), QuantSpec(8, -1, sym=False), QuantSpec(4, 32, sym=False), QuantSpec(4, 64, sym=False),
         QuantSpec(4, 128, sym=False), QuantSpec(4, -1, sym=False)]


# ---- packing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [32, 172, 13])
def test_pack_unpack_round_trip_is_exact(bits, rows):
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 1 << bits, (rows, 24), generator=g)
    assert torch.equal(unpack_rows(pack_rows(codes, bits), bits, rows).long(), codes)
    assert torch.equal(unpack_cols(pack_cols(codes, bits), bits, 24).long(), codes)
    assert pack_rows(codes, bits).shape == (-(-rows // (32 // bits)), 24)


def test_packed_word_layout_is_gptq_s():
    """Word r of column j holds codes[r * 8 + k, j] at bits 4k..4k+3 (lowest first), int32 bits."""
    codes = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]])
    word = pack_rows(codes, 4)[0, 0].item()
    expected = sum(int(c) << (4 * k) for k, c in enumerate(codes[:, 0]))
    assert word == expected - (1 << 32)  # top nibble 15 sets the sign bit
    codes8 = torch.tensor([[0x11, 0x22, 0x33, 0x44]])
    assert pack_cols(codes8, 8)[0, 0].item() == 0x44332211


# ---- RTN and GPTQ -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_rtn_round_trip_within_half_a_step(spec):
    w = torch.randn(48, 172, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3] = w[3].abs()  # a row with no negative weight: the zero point must stay >= 1
    res = rtn_quantize(w, spec)
    packed = QuantizedWeight.from_result(res, spec.bits)
    assert torch.equal(packed.codes().long(), res.codes)
    assert torch.equal(packed.zeros().long(), res.zeros)
    step = res.scales[res.g_idx.long()].t()  # [out, in]
    err = (packed.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-6).all(), (err / step).max()
    assert res.zeros.min() >= 1 and res.codes.max() <= spec.maxq
    assert res.scales.shape == (spec.groups(172), 48)


def _correlated_inputs(n: int, rows: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, n, generator=g) @ (torch.randn(n, n, generator=g) / n ** 0.5)
    x[:, :4] *= 6  # a few outlier channels, as real activations have
    return x


@pytest.mark.parametrize("spec", SPECS + [QuantSpec(4, 64, sym=False, desc_act=True)], ids=str)
def test_gptq_beats_rtn_on_layer_output_error(spec):
    w = torch.randn(64, 172, generator=torch.Generator().manual_seed(2)) * 0.05
    x = _correlated_inputs(172)
    acc = HessianAccumulator(172)
    acc.add(x)
    rtn, gptq = rtn_quantize(w, spec), gptq_quantize(w, acc.hessian(), spec)

    def out_err(res) -> float:
        return ((x @ (w - res.dequantize()).t()) ** 2).mean().item()

    assert out_err(gptq) < 0.7 * out_err(rtn), (out_err(gptq), out_err(rtn))


def test_gptq_act_order_groups_follow_the_permutation():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(64)
    acc = HessianAccumulator(64)
    acc.add(x)
    res = gptq_quantize(w, acc.hessian(), QuantSpec(4, 32, sym=False, desc_act=True))
    # The outlier channels (largest Hessian diagonal) are visited first, so they sit in group 0.
    assert (res.g_idx[:4] == 0).all()
    assert sorted(torch.bincount(res.g_idx.long()).tolist()) == [32, 32]


# ---- linear objects -----------------------------------------------------------------------------

def _qweights(shapes, spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [QuantizedWeight.from_result(rtn_quantize(torch.randn(o, i, generator=g), spec), spec.bits)
            for o, i in shapes]


def test_fused_quantized_projections_equal_separate_ones():
    spec = QuantSpec(4, 32, sym=False)
    q, k, v = _qweights([(64, 64), (32, 64), (32, 64)], spec)
    bias = [torch.randn(64), torch.randn(32), torch.randn(32)]
    x = torch.randn(5, 64)
    fused = fused_linear([q, k, v], bias)
    assert isinstance(fused, QuantLinear)
    ref = torch.cat([x @ w.dequantize().t() + b for w, b in zip((q, k, v), bias)], dim=-1)
    torch.testing.assert_close(fused(x), ref, rtol=1e-5, atol=1e-5)
    # Different g_idx (e.g. separately made act-order weights): parts run on their own.
    shuffled = QuantizedWeight(k.qweight, k.qzeros, k.scales, k.g_idx.flip(0), 4, 1, 64, 32)
    assert isinstance(fused_linear([q, shuffled]), ConcatLinear)


# ---- checkpoints --------------------------------------------------------------------------------

def _autogptq_tensors(w: torch.Tensor, bits: int, group: int, perm: torch.Tensor | None, fmt: str):
    """What AutoGPTQ writes for w [out, in]: RTN codes per group, with groups taken over the input
    channels in `perm` order (act-order); zero points stored minus 1 in the classic format."""
    out, n = w.shape
    order = perm if perm is not None else torch.arange(n)
    g_idx = torch.empty(n, dtype=torch.int32)
    g_idx[order] = (torch.arange(n) // group).to(torch.int32)
    spec = QuantSpec(bits, group, sym=False)
    res = rtn_quantize(w[:, order], spec)  # groups over consecutive permuted columns
    codes = torch.empty_like(res.codes)
    codes[:, order] = res.codes
    scales = res.scales.half()
    deq = (codes - res.zeros[g_idx.long()].t()).float() * scales.float()[g_idx.long()].t()
    stored_zeros = res.zeros - (1 if fmt == "gptq" else 0)
    return {"qweight": pack_rows(codes.t(), bits), "qzeros": pack_cols(stored_zeros, bits), "scales": scales,
            "g_idx": g_idx}, deq


def _write_autogptq_dir(tmp_path, model, bits, group, desc_act, fmt="gptq"):
    from safetensors.torch import save_file

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ours = model_config_from_hf(model.config, "llama")
    expected = {}
    g = torch.Generator().manual_seed(7)
    for name in ours.arch.projection_names(ours):  # the decoder's linears, as AutoGPTQ quantizes them
        base = name.removesuffix(".weight")
        w = state.pop(name)
        perm = torch.randperm(w.shape[1], generator=g) if desc_act else None
        tensors, expected[name] = _autogptq_tensors(w, bits, group, perm, fmt)
        state |= {f"{base}.{k}": t for k, t in tensors.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = model.config.to_dict()
    config["architectures"] = list(ours.arch.hf_classes)
    config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                     "desc_act": desc_act, "sym": False, "checkpoint_format": fmt}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_gguf_tokenizer(STORIES_GGUF, tmp_path / "tokenizer.gguf")  # any tokenizer the loader reads
    return expected


@pytest.fixture(scope="module")
def tiny_llama():
    return random_hf_model("llama", seed=3, intermediate_size=96)


@pytest.mark.parametrize("bits,group,desc_act,fmt", [(4, 32, False, "gptq"), (4, 64, True, "gptq"),
                                                     (8, 32, True, "gptq"), (4, 32, False, "gptq_v2")])
def test_autogptq_checkpoint_loads_to_the_same_dequantized_weights(tmp_path, tiny_llama, bits, group, desc_act, fmt):
    expected = _write_autogptq_dir(tmp_path, tiny_llama, bits, group, desc_act, fmt)
    ck = load_checkpoint(tmp_path)
    for name, w in expected.items():
        got = ck.weights[name]
        assert isinstance(got, QuantizedWeight), name
        torch.testing.assert_close(got.dequantize(), w, rtol=0, atol=0)


def test_quantized_checkpoint_runs_like_transformers_on_the_dequantized_weights(tmp_path, tiny_llama, make_engine):
    from pdserve.runtime.sampling_params import SamplingParams

    expected = _write_autogptq_dir(tmp_path, tiny_llama, 4, 32, True)
    ck = load_checkpoint(tmp_path)
    ref = random_hf_model("llama", seed=3, intermediate_size=96)
    with torch.no_grad():
        sd = ref.state_dict()
        for name, w in expected.items():
            sd[name].copy_(w)
    engine = make_engine(model_config_from_hf(ref.config, "llama"), ck.weights)
    engine.keep_logits = True
    prompt = [1, 5, 9, 33, 70, 100, 12]
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    engine.step()
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(engine.last_logits[0], want, rtol=1e-4, atol=1e-4)


# ---- bad input ----------------------------------------------------------------------------------

def test_unsupported_quantize_requests_are_refused():
    with pytest.raises(QuantError, match=r"unsupported bits 3 \(supported: 4, 8\)"):
        check_quantize_request(3, 128, "rtn")
    with pytest.raises(QuantError, match=r"unsupported group size 48"):
        check_quantize_request(4, 48, "gptq")
    with pytest.raises(QuantError, match=r"unsupported method 'awq'"):
        check_quantize_request(4, 128, "awq")


def test_int8_is_symmetric_unless_asym_is_asked():
    assert check_quantize_request(8, -1, "rtn").sym
    assert not check_quantize_request(8, -1, "gptq", asym=True).sym
    assert not check_quantize_request(4, 128, "rtn").sym


def test_checkpoint_whose_config_and_tensors_disagree_is_refused(tmp_path, tiny_llama):
    _write_autogptq_dir(tmp_path, tiny_llama, 4, 32, False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"q_proj.qweight has shape \(8, 64\), expected \(16, 64\) for "
                                              r"bits=8, group_size=32 \(the quantization config and the tensors"):
        load_checkpoint(tmp_path)
    config["quantization_config"] |= {"bits": 4, "group_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"qzeros has shape \(2, 8\), expected \(1, 8\)"):
        load_checkpoint(tmp_path)
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"GPTQ-quantized \(\*\.qweight\) but there is no quantization_config"):
        load_checkpoint(tmp_path)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported GPTQ bits 3"):
        load_checkpoint(tmp_path)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported quant_method 'awq'"):
        load_checkpoint(tmp_path)


def test_checkpoint_missing_a_scales_tensor_is_refused_by_name(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    _write_autogptq_dir(tmp_path, tiny_llama, 4, 32, False)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = next(k for k in sorted(state) if k.endswith(".scales"))
    del state[name]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert name in message and "\n" not in message, message
