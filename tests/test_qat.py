"""QAT (`pdserve qat`): the fake-quant op against the export's quantizer, its straight-through
gradient against the identity's, QAT against RTN on held-out KL, and the exported checkpoint
reloaded bit-exactly and served like the in-process model. One short QAT run on stories260K
(INT4 g32: its 172-wide FFN takes groups of 32 with a shorter last one), shared by the module."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import STORIES_GGUF
from pdserve import cli
from pdserve.commands.quant_eval import PROMPTS
from pdserve.quant.calibration import load_texts
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.layerwise import quantize_model
from pdserve.quant.qat import (EVAL_PROMPTS_CHAT, PROMPT_SETS, QATConfig, fake_quant, fake_quantize, fake_quantized,
                               heldout_logits, kl_top1, projection_names, qat_quantize, save_qat_checkpoint)
from pdserve.quant.quantizer import rtn_quantize
from pdserve.quant.spec import QuantSpec
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams

SPEC = QuantSpec(4, 32, sym=False)
# 40 steps of 8 x 128 tokens: about 5 s of CPU here, and already about half of RTN's KL.
RUN = QATConfig(SPEC, steps=40, lr=3e-4, batch=8, seq_len=128, gen_tokens=128)
SPECS = [SPEC, QuantSpec(4, 128, sym=False), QuantSpec(8, -1, sym=True), QuantSpec(8, -1, sym=False)]


# ---- the op ---------------------------------------------------------------------------------------

def _weight(out: int = 48, n: int = 172, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out, n, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[3] = w[3].abs()  # no negative weight: the zero point floors at 1
    w[5, :40] *= 20  # an outlier group
    return w


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_fake_quant_forward_is_the_exports_rtn(spec):
    """The vectorised forward (groups padded with zeros) equals the export's group-by-group RTN."""
    w = _weight()
    assert torch.equal(fake_quant(w, spec), rtn_quantize(w, spec).dequantize())


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_straight_through_gradient_is_the_identitys(spec):
    """d loss / d w through fake_quantize equals d loss / d w_q of the same loss on w_q = quant(w)
    as a plain tensor: the gradient passes rounding unchanged, for every (in-range) weight."""
    w = _weight().requires_grad_(True)
    x = torch.randn(16, 172, generator=torch.Generator().manual_seed(1))
    target = torch.randn(16, 48, generator=torch.Generator().manual_seed(2))
    F.mse_loss(F.linear(x, fake_quantize(w, spec)), target).backward()
    wq = rtn_quantize(w.detach(), spec).dequantize().requires_grad_(True)
    F.mse_loss(F.linear(x, wq), target).backward()
    assert torch.equal(w.grad, wq.grad)
    assert w.grad.abs().min() > 0  # no weight was cut off


# ---- one QAT run ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model: a second thread buys nothing and, on a loaded machine, makes torch's ops wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def source():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def qat(source, tmp_path_factory):
    """(the run's result, its exported directory reloaded, the directory)."""
    torch.manual_seed(0)
    result = qat_quantize(source, RUN)
    out = save_qat_checkpoint(tmp_path_factory.mktemp("qat") / "stories-qat", source, result)
    return result, load_checkpoint(out), out


@pytest.fixture(scope="module")
def heldout(source):
    """stories260k_eval.jsonl: texts the FP32 model sampled from BOS (seeds 2000..), not from the
    training prompts (seeds 3000..), and the FP32 logits at all of their positions."""
    seqs = [source.tokenizer.encode(t) for t in load_texts("stories260k-eval")]
    return seqs, heldout_logits(source.config, source.weights, seqs)


def test_qat_beats_rtn_on_heldout_kl(source, qat, heldout):
    _, reloaded, _ = qat
    seqs, ref = heldout
    rtn = quantize_model(source.config, source.weights, SPEC, "rtn")
    rtn_kl, rtn_top1, n = kl_top1(ref, heldout_logits(source.config, rtn, seqs))
    qat_kl, qat_top1, _ = kl_top1(ref, heldout_logits(reloaded.config, reloaded.weights, seqs))
    assert n > 8000
    assert qat_kl < 0.75 * rtn_kl, (qat_kl, rtn_kl)  # measured: about 0.045 vs 0.091
    assert qat_top1 > rtn_top1, (qat_top1, rtn_top1)


def test_export_reloads_to_the_weights_training_ended_with(source, qat):
    result, reloaded, out = qat
    fake = fake_quantized(result.latent, SPEC)
    for name in projection_names(source.config):
        w = reloaded.weights[name]
        assert isinstance(w, QuantizedWeight)
        assert torch.equal(w.dequantize(), fake[name]), name
    for name, t in source.weights.items():
        if name not in fake:
            assert torch.equal(reloaded.weights[name], t), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["method"], qc["bits"], qc["group_size"], qc["sym"]) == ("gptq", "qat", 4, 32, False)
    prov = qc["pdserve"]
    assert prov["created_by"] == "pdserve qat"
    assert (prov["qat"]["steps"], prov["qat"]["lr"]) == (RUN.steps, RUN.lr)
    assert prov["qat"]["teacher"] == "fp32 stories260K.gguf"
    assert prov["calibration"]["prompts"] == "stories" and prov["calibration"]["rows"] > 0
    assert len(result.losses) == RUN.steps and result.losses[-1] < result.losses[0]


def test_reloaded_checkpoint_serves_the_in_process_model(source, qat):
    """Greedy output of an engine on the reloaded directory equals that of an engine on the
    in-process trained model (its fake-quantized weights, dense) and on the in-memory export."""
    result, reloaded, _ = qat
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    cache = EngineConfig(cache=CacheConfig(num_blocks=256))

    def outputs(engine: Engine) -> list[list[int]]:
        seqs = engine.generate(prompts, greedy)
        engine.check_leaks()
        return [s.output_ids for s in seqs]

    served = outputs(Engine.from_checkpoint(reloaded, cache))
    dense = {**source.weights, **fake_quantized(result.latent, SPEC)}
    assert served == outputs(Engine(source.config, dense, reloaded.fingerprint, cache))
    assert served == outputs(Engine(source.config, result.weights, reloaded.fingerprint, cache))


# ---- data and arguments -------------------------------------------------------------------------------

def test_training_prompts_are_disjoint_from_heldout_text():
    stories = PROMPT_SETS["stories"].read_text().splitlines()
    assert not any(p.startswith(q) or q.startswith(p) for p in stories for q in PROMPTS)
    chat = set(PROMPT_SETS["chat"].read_text().splitlines())
    assert chat.isdisjoint(EVAL_PROMPTS_CHAT.read_text().splitlines())
    assert len(stories) == len(set(stories)) == 64 and len(chat) == 64


@pytest.mark.parametrize("args,names", [
    (["--bits", "3"], "bits 3"),
    (["--group-size", "48"], "group size 48"),
    (["--steps", "0"], "--steps"),
    (["--lr", "-1"], "--lr"),
    (["--seq-len", "1"], "--seq-len"),
    (["--batch", "0"], "--batch"),
    (["--calibration", "no-such-set"], "--calibration"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's context"),
    (["--json", "x.json"], "add --compare"),
])
def test_bad_arguments_give_one_line_errors(args, names, tmp_path, capsys):
    code = cli.main(["qat", "--model", str(STORIES_GGUF), "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pdserve qat: error: ") and err.count("\n") == 1 and names in err, err
    assert not (tmp_path / "x").exists()


def test_command_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "q"
    code = cli.main(["qat", "--model", str(STORIES_GGUF), "--bits", "8", "--steps", "2", "--batch", "2",
                     "--seq-len", "32", "--gen-tokens", "16", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["method"], qc["bits"], qc["group_size"], qc["sym"]) == ("qat", 8, -1, True)
    engine = Engine.from_checkpoint(load_checkpoint(out), EngineConfig(cache=CacheConfig(num_blocks=64)))
    assert len(engine.generate([[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].output_ids) == 8
