"""W8A8 (dynamic and static INT8 activations) and mixed INT4/INT8 formats: each linear against its
fp32 fake-quantization reference, batched against unbatched, `pdserve quantize` checkpoints against
the in-process quantized model, the stack against the in-process engine, and bad files refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.quant.calibration import load_texts, token_chunks
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.int8_act import (ActQuant, Int8ActWeight, MinMaxObserver, PercentileObserver, W8A8Linear,
                                    static_params)
from pdserve.quant.layerwise import quantize_model, quantize_w8a8
from pdserve.quant.linear import ConcatLinear, DenseLinear, QuantLinear, fused_linear
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import ActSpec, QuantSpec, attention_rules, match_dynamic
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import ModelLoadError, load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2

PROMPTS = ["Once upon a time", "Tom had a red ball.", "The little dog was sad because"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
CALIB = ("--calib-samples", "4", "--calib-seq-len", "32")  # small: these tests check plumbing, not accuracy
INT8 = QuantSpec(8, -1, sym=True)


# ---- the linears against fp32 fake quantization ---------------------------------------------------

def _int8_weight(out: int, n: int, act: ActQuant, seed: int = 0) -> Int8ActWeight:
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed)) * 0.05
    return Int8ActWeight(QuantizedWeight.from_result(rtn_quantize(w, INT8), 8), act)


def _fake_quant_dynamic(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric INT8, in float64: round(x / s) * s with s = max|x| / 127."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / s) * s


def _fake_quant_static(x: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return (torch.clamp(torch.round(x / scale) + zp, -128, 127) - zp) * scale


def _inputs(rows: int, n: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 8  # an outlier channel, as real activations have
    return x


def test_dynamic_w8a8_linear_equals_fake_quantized_fp32():
    w = _int8_weight(48, 172, ActQuant("dynamic"))
    bias = torch.randn(48)
    x = _inputs(9, 172)
    got = W8A8Linear.of([w], bias)(x)
    ref = _fake_quant_dynamic(x.double()) @ w.weight.dequantize().double().t() + bias.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # bf16 activations: the same integer math, the output rounded to bf16.
    got_bf16 = W8A8Linear.of([w], None)(x.bfloat16())
    assert got_bf16.dtype == torch.bfloat16
    ref_bf16 = _fake_quant_dynamic(x.bfloat16().double()) @ w.weight.dequantize().double().t()
    torch.testing.assert_close(got_bf16.double(), ref_bf16, rtol=1e-2, atol=1e-2)


def test_static_w8a8_linear_equals_fake_quantized_fp32_with_clamping():
    x = _inputs(9, 172)
    act = static_params(-2.0, 3.0)  # narrower than x: values outside are clamped
    scale, zp = float(act.scale), int(act.zero_point)
    assert -128 <= zp <= 127 and abs((127 - zp) * scale - 3.0) < scale  # the range maps onto the codes
    w = _int8_weight(48, 172, act)
    got = W8A8Linear.of([w])(x)
    ref = _fake_quant_static(x.double(), scale, zp) @ w.weight.dequantize().double().t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_fused_w8a8_projections_equal_separate_ones():
    act = static_params(-4.0, 4.0)
    q, k, v = (_int8_weight(o, 64, act, seed=s) for s, o in enumerate((64, 32, 32)))
    x = _inputs(5, 64)
    fused = fused_linear([q, k, v])
    assert isinstance(fused, W8A8Linear)
    torch.testing.assert_close(fused(x), torch.cat([W8A8Linear.of([p])(x) for p in (q, k, v)], -1), rtol=0, atol=0)
    other = _int8_weight(32, 64, static_params(-1.0, 1.0), seed=9)  # another input scale: runs apart
    assert isinstance(fused_linear([q, other]), ConcatLinear)


def test_observers_match_numpy():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(300, 16, generator=g) * (1 + i) for i in range(3)]
    minmax, pct = MinMaxObserver(), PercentileObserver(99.9)
    for b in batches:
        minmax.add(b)
        pct.add(b)
    values = torch.cat(batches).flatten().numpy()
    want = static_params(float(values.min()), float(values.max()))
    assert torch.equal(minmax.params().scale, want.scale) and torch.equal(minmax.params().zero_point, want.zero_point)
    lo, hi = (float(np.percentile(values, q, method="inverted_cdf")) for q in (0.1, 99.9))
    want = static_params(lo, hi)
    assert torch.equal(pct.params().scale, want.scale) and torch.equal(pct.params().zero_point, want.zero_point)


def test_dynamic_rules_match_like_gptqmodel():
    rules = attention_rules(16) | {r".*\.mlp\.down_proj": {"bits": 8, "group_size": -1}}
    assert match_dynamic(rules, "model.layers.3.self_attn.q_proj") is None
    assert match_dynamic(rules, "model.layers.3.mlp.down_proj") == {"bits": 8, "group_size": -1}
    assert match_dynamic(rules, "model.layers.3.mlp.gate_proj") == {}
    assert match_dynamic(attention_rules(8), "model.layers.0.self_attn.o_proj")["bits"] == 8


# ---- checkpoints made by `pdserve quantize` -------------------------------------------------------

def quantize(out, *flags: str) -> int:
    args = build_parser().parse_args(["quantize", "--model", str(STORIES_GGUF), "--out", str(out), *flags])
    return args._run(args)


@pytest.fixture(scope="module")
def fp32():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def calib(fp32):
    return token_chunks(fp32.tokenizer, load_texts("stories260k"), 32, 4)


# name -> (quantize flags, in-process builder of the same format)
FORMATS = {
    "dynamic-int8": (("--method", "dynamic-int8"),
                     lambda ck, calib: quantize_w8a8(ck.config, ck.weights, ActSpec("dynamic"))),
    "w8a8": (("--method", "w8a8", *CALIB),
             lambda ck, calib: quantize_w8a8(ck.config, ck.weights, ActSpec("static", "minmax"), calib)),
    "mixed-gptq-attn8": (("--method", "gptq", "--bits", "4", "--group-size", "128", "--attention-bits", "8", *CALIB),
                         lambda ck, calib: quantize_model(ck.config, ck.weights, QuantSpec(4, 128, sym=False), "gptq",
                                                          calib, rules=attention_rules(8))),
    "mixed-rtn-attn16": (("--method", "rtn", "--bits", "4", "--attention-bits", "16"),
                         lambda ck, calib: quantize_model(ck.config, ck.weights, QuantSpec(4, 128, sym=False), "rtn",
                                                          rules=attention_rules(16))),
}
# The linear classes each format's layer 0 must be built of: (qkv, o, gate_up, down).
LINEARS = {"dynamic-int8": (W8A8Linear,) * 4, "w8a8": (W8A8Linear,) * 4,
           "mixed-gptq-attn8": (QuantLinear,) * 4,
           "mixed-rtn-attn16": (DenseLinear, DenseLinear, QuantLinear, QuantLinear)}


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory):
    dirs = {}
    for name, (flags, _) in FORMATS.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        assert quantize(dirs[name], *flags) == 0, name
    return dirs


def _engine(config, weights, fingerprint="f" * 32) -> Engine:
    return Engine(config, weights, fingerprint, EngineConfig(cache=CacheConfig(num_blocks=128)))


def _greedy(engine: Engine, prompts: list[list[int]], batched: bool = True) -> list[list[int]]:
    if batched:
        return [s.output_ids for s in engine.generate(prompts, GREEDY)]
    return [engine.generate([p], GREEDY)[0].output_ids for p in prompts]


@pytest.mark.parametrize("name", list(FORMATS))
def test_checkpoint_reloads_to_the_in_process_model(name, quantized_dirs, fp32, calib):
    ck = load_checkpoint(quantized_dirs[name])
    layer = Engine.from_checkpoint(ck, EngineConfig(cache=CacheConfig(num_blocks=128))).runner.model.layers[0]
    assert tuple(type(getattr(layer, s)) for s in ("qkv", "o", "gate_up", "down")) == LINEARS[name]
    prompts = [fp32.tokenizer.encode(p) for p in PROMPTS]
    in_process = _engine(fp32.config, FORMATS[name][1](fp32, calib))
    reloaded = _engine(ck.config, ck.weights)
    want = _greedy(in_process, prompts)
    assert _greedy(reloaded, prompts) == want
    assert _greedy(reloaded, prompts, batched=False) == want  # batched equals unbatched
    in_process.check_leaks()
    reloaded.check_leaks()


def test_checkpoint_records_the_formats(quantized_dirs):
    w8a8 = json.loads((quantized_dirs["w8a8"] / "config.json").read_text())["quantization_config"]
    assert (w8a8["bits"], w8a8["group_size"], w8a8["sym"], w8a8["method"]) == (8, -1, True, "w8a8")
    assert w8a8["pdserve"]["activations"] == {"scheme": "static", "bits": 8, "granularity": "tensor",
                                              "sym": False, "observer": "minmax"}
    tensors = load_file(str(quantized_dirs["w8a8"] / "model.safetensors"))
    assert tensors["model.layers.0.mlp.down_proj.input_scale"].shape == (1,)
    assert tensors["model.layers.0.mlp.down_proj.input_zero_point"].dtype == torch.int32
    mixed = json.loads((quantized_dirs["mixed-rtn-attn16"] / "quantize_config.json").read_text())
    assert mixed["dynamic"] == {r"-:.*\.self_attn\..*": {}}
    tensors = load_file(str(quantized_dirs["mixed-rtn-attn16"] / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.layers.0.mlp.up_proj.qweight" in tensors


# ---- bad files and flags --------------------------------------------------------------------------

def _broken_copy(src, dst, edit_tensors=None, edit_config=None):
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config["quantization_config"])
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.gguf").write_bytes((src / "tokenizer.gguf").read_bytes())
    return dst


def _one_line_error(path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_inconsistent_checkpoints_are_refused(quantized_dirs, tmp_path):
    src, p = quantized_dirs["w8a8"], "model.layers.1.self_attn.k_proj"
    _one_line_error(_broken_copy(src, tmp_path / "a", lambda t: t.pop(f"{p}.input_scale")),
                    rf"missing tensor {p}\.input_scale \(quantization_config\.pdserve\.activations is static\)")
    four = torch.zeros(4, dtype=torch.int32)
    _one_line_error(_broken_copy(src, tmp_path / "b", lambda t: t.update({f"{p}.input_zero_point": four})),
                    rf"tensor {p}\.input_zero_point has shape \(4,\), expected \(1,\)")
    _one_line_error(_broken_copy(src, tmp_path / "c", lambda t: t.update({f"{p}.input_scale": torch.tensor([-1.0])})),
                    rf"tensor {p}\.input_scale is -1\.0, expected a positive finite scale")
    _one_line_error(_broken_copy(quantized_dirs["mixed-gptq-attn8"], tmp_path / "d",
                                 edit_config=lambda c: c["pdserve"].update(activations={"scheme": "dynamic"})),
                    r"activation quantization needs INT8 weights with one group per output channel")
    _one_line_error(_broken_copy(quantized_dirs["mixed-gptq-attn8"], tmp_path / "e",
                                 edit_config=lambda c: c["dynamic"].update({r"-:.*\.mlp\..*": {}})),
                    r"mlp\.gate_proj\.qweight is quantized but quantization_config\.dynamic leaves")
    _one_line_error(_broken_copy(src, tmp_path / "f",
                                 edit_config=lambda c: c["pdserve"]["activations"].update(scheme="x")),
                    r"unsupported activation scheme 'x'")


def test_quantize_refuses_inconsistent_flags(tmp_path, capsys):
    assert quantize(tmp_path / "a", "--method", "w8a8", "--bits", "4") == 2
    assert "--method w8a8 makes INT8 per-channel symmetric weights for every projection: drop --bits" \
        in capsys.readouterr().err
    assert quantize(tmp_path / "b", "--method", "gptq", "--observer", "minmax") == 2
    assert "--observer needs --method w8a8" in capsys.readouterr().err
    assert quantize(tmp_path / "c", "--method", "w8a8", "--observer", "mse") == 2
    assert "static activation scales need an observer (minmax or percentile), got 'mse'" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")


# ---- served ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(quantized_dirs):
    s = start_stack(1, 1, "--model", str(quantized_dirs["w8a8"]))
    yield s
    s.stop()


def test_stack_serves_the_w8a8_checkpoint_like_the_in_process_engine(stack, quantized_dirs):
    ck = load_checkpoint(quantized_dirs["w8a8"])
    expected = _greedy(Engine.from_checkpoint(ck, EngineConfig(cache=CacheConfig(num_blocks=128))),
                       [ck.tokenizer.encode(p) for p in PROMPTS])
    stub = stack.gateway_stub()
    for prompt, want in zip(PROMPTS, expected):
        params = common_pb2.SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True)
        chunks = list(stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, sampling=params)))
        assert [t for c in chunks for t in c.token_ids] == want, prompt
