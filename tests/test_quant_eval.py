"""`pdserve quant-eval`'s harness (pdserve.quant.accuracy) on stories260K: batched KL / top-1 /
perplexity against one sequence at a time and torch's own kl_div, the task scorer on fixed answers,
the command's table."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.commands import quant_eval
from pdserve.quant import accuracy
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint


@pytest.fixture(scope="module")
def fp32():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def engines(fp32):
    """The FP32 engine and one on INT4 RTN g32 weights of the same file."""
    config = EngineConfig(cache=CacheConfig(num_blocks=128))
    int4 = quant_eval.quantized_weights(fp32, quant_eval.Format("q", 4, 32, "rtn"), None)
    yield Engine.from_checkpoint(fp32, config), Engine(fp32.config, int4, "int4", config)


def scored_sequences(fp32) -> list[accuracy.Scored]:
    tok = fp32.tokenizer
    prompts = ["Once upon a time", "Tom had a red ball.", "The bird flew high", "It was a rainy day."]
    stories = [tok.encode(p + " There was a little girl named Lily. She liked to play outside in the sun.")
               for p in prompts]
    return [accuracy.Scored(ids, len(tok.encode(p))) for p, ids in zip(prompts, stories)]


def one_by_one(engine, seqs: list[accuracy.Scored]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence alone through the single-sequence forward (`sequence_logits`, all positions):
    the logits predicting each scored token, and the tokens."""
    logits, targets = [], []
    for s in seqs:
        out = quant_eval.sequence_logits(engine.runner.model, s.ids)  # [T, V]
        logits.append(out[s.start - 1:-1])
        targets += s.ids[s.start:]
    return torch.cat(logits).double(), torch.tensor(targets)


def test_kl_top1_ppl_match_a_direct_computation(fp32, engines):
    """Batched teacher forcing (two forwards of two sequences each, the head on scored rows only)
    against each sequence alone, with torch's own kl_div and cross_entropy and a per-position loop."""
    ref_engine, int4_engine = engines
    seqs = scored_sequences(fp32)
    reference = accuracy.Reference(ref_engine, seqs, max_batch_tokens=2 * max(len(s.ids) for s in seqs))
    assert len(reference.batches) == 2
    got = reference.compare(int4_engine)

    p, targets = one_by_one(ref_engine, seqs)
    q, _ = one_by_one(int4_engine, seqs)
    kl = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="batchmean").item()
    top1 = sum(int(p[i].argmax() == q[i].argmax()) for i in range(len(targets))) / len(targets)
    ppl = torch.exp(F.cross_entropy(q, targets)).item()

    assert got.positions == len(targets) == sum(s.positions for s in seqs)
    assert kl > 0.005  # INT4 RTN really differs: the comparison below is not of zeros
    assert got.kl == pytest.approx(kl, rel=1e-3)
    assert abs(got.top1 - top1) <= 1 / len(targets)  # at most one exact near-tie may flip
    assert got.ppl == pytest.approx(ppl, rel=1e-4)
    same = reference.compare(ref_engine)
    assert same.kl == pytest.approx(0.0, abs=1e-9) and same.top1 == 1.0


def test_trim_and_batches():
    seqs = [accuracy.Scored(list(range(12)), 4), accuracy.Scored(list(range(8)), 2)]  # 8 and 6 scored
    cut = accuracy.trim(seqs, 9)
    assert [s.positions for s in cut] == [5, 4] and cut[1].ids == [0, 1, 2, 3, 4, 5]  # as even as can be
    assert [s.positions for s in accuracy.trim(seqs, 13)] == [7, 6]
    assert [s.positions for s in accuracy.trim(seqs, 14)] == [8, 6]  # the second has only 6
    assert accuracy.batches(seqs, 19) == [[seqs[0]], [seqs[1]]]
    assert accuracy.batches(seqs, 20) == [seqs]


@pytest.mark.parametrize(("answer", "known", "right"), [
    ("17 + 25 = 42.", "42", True),
    ("The answer is 42\nbecause 17 + 25 = 42", "42", True),
    ("\n\n  42", "42", True),  # the first non-empty line
    ("17 + 25 = 32.\nNo wait, it is 42.", "42", False),  # only the first line counts
    ("It is 142.", "42", False),  # a number inside another is not the answer
    ("The capital of France is Paris.", "Paris", True),
    ("the capital of france is paris", "Paris", True),  # case does not matter
    ("Parisian food is good.", "Paris", False),
    ("It is Buenos Aires, of course.", "Buenos Aires", True),
    ("", "42", False),
])
def test_task_scorer(answer, known, right):
    assert accuracy.is_correct(answer, (known,)) is right


def test_task_score_counts_right_answers(fp32, engines):
    """The FP32 engine's own greedy answers, scored against answers taken from them (all right) and
    against answers no first line holds (none right)."""
    ref_engine = engines[0]
    tasks = [accuracy.Task(q, ("zzz-never",)) for q in ("What is 2 + 2?", "Tell me a story.")]
    wrong = accuracy.task_score(ref_engine, fp32.tokenizer, tasks, max_tokens=8)
    assert wrong.score == 0.0 and len(wrong.answers) == 2
    words = [accuracy.first_line(a).split()[0] for a in wrong.answers]
    right = accuracy.task_score(ref_engine, fp32.tokenizer,
                                [accuracy.Task(t.question, (w,)) for t, w in zip(tasks, words)], max_tokens=8)
    assert right.score == 1.0 and right.answers == wrong.answers


def test_committed_sets_are_well_formed():
    from pdserve.quant.calibration import CALIB_PROMPTS, load_prompts

    held, calib = load_prompts(accuracy.HELDOUT_PROMPTS), load_prompts(CALIB_PROMPTS)
    assert len(held) == 40 and len(calib) == 64 and not set(held) & set(calib)
    tasks = accuracy.load_tasks()
    assert len(tasks) == 50 and all(t.answers and not accuracy.is_correct(t.question, t.answers) for t in tasks)


def test_quant_eval_only_prints_the_table(tmp_path, capsys):
    out = tmp_path / "qe.json"
    args = build_parser().parse_args(["quant-eval", "--model", str(STORIES_GGUF), "--only", "int8", "int4-gguf",
                                      "int4-gptq-g128", "--calib-samples", "8", "--curve", "4", "8", "--positions", "48", "--tasks", "3", "--speed-rounds", "1", "--threads", "1",
                                      "--rss", "none", "--kv-transfer", "--json", str(out)])
    assert args._run(args) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:4] == ["format", "bits/w", "wt", "MB"]
    assert "int4-gguf" in text and "skipped" in text  # stories260K's tensors are float, not Q4
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["formats"]}
    assert list(rows) == ["fp32", "int8", "int4-gguf", "int4-gptq-g128"]
    assert rows["fp32"]["kl"] == 0.0 and rows["fp32"]["top1"] == 1.0 and rows["fp32"]["positions"] == 48
    assert 0 < rows["int8"]["kl"] < 0.01 and rows["int8"]["bits_per_weight"] < 16  # bf16 would be 16
    # the row is what `pdserve quantize` writes, served as `pdserve up` would serve it
    assert rows["int8"]["recipe"] == "pdserve quantize --method rtn --bits 8"
    assert rows["int8"]["serve"] == "--dtype bfloat16 --weight-format auto" and rows["int8"]["make_s"] > 0
    assert rows["int8"]["rss_mb"] is None  # --rss none
    assert rows["int8"]["tokens_per_s_32"] > 0 and rows["int8"]["ttft_200_s"] > 0
    # on the wire: the cache's bytes plus a header per block (stories260K: 16 tokens a block)
    assert 0 < rows["int8"]["kv_wire_bytes_per_token"] - rows["int8"]["kv_bytes_per_token"] < 20
    assert rows["int8"]["kv_transfer_s"] > 0
    # the curve's point at the row's own calibration rows is that row
    assert [p["samples"] for p in data["curve"]] == [4, 8] and "GPTQ int4 g128 vs calibration rows" in text
    assert data["curve"][1]["kl"] == pytest.approx(rows["int4-gptq-g128"]["kl"], rel=1e-9)


def test_serving_rss_of_a_fresh_process():
    flags = ["--model", str(STORIES_GGUF), "--dtype", "float32", "--num-blocks", "8", "--threads", "1"]
    rss = accuracy.serving_rss(flags)
    assert rss["rss"] > rss["rss_before_load"] > 50e6  # torch alone is more than 50 MB
    assert rss["weight_format"] == "dense"


def test_quant_eval_refuses_an_unknown_row(capsys):
    args = build_parser().parse_args(["quant-eval", "--model", str(STORIES_GGUF), "--only", "int3"])
    assert args._run(args) == 2
    assert "--only: unknown row(s) int3" in capsys.readouterr().err


def test_prebuilt_row_serves_the_given_checkpoint(tmp_path, capsys):
    """--prebuilt ROW=DIR serves a checkpoint made beforehand (here by `pdserve quantize`, as the row
    itself would make it): same accuracy as the row that makes its own, and nothing made."""
    parser = build_parser()
    made = tmp_path / "int8"
    quantize = parser.parse_args(["quantize", "--model", str(STORIES_GGUF), "--method", "rtn", "--bits", "8",
                                  "--out", str(made)])
    assert quantize._run(quantize) == 0
    runs = {}
    for name, extra in (("own", []), ("prebuilt", ["--prebuilt", f"int8={made}"])):
        out = tmp_path / f"{name}.json"
        args = parser.parse_args(["quant-eval", "--model", str(STORIES_GGUF), "--only", "int8", "--positions", "32",
                                  "--tasks", "0", "--speed-rounds", "1", "--threads", "1", "--rss", "none",
                                  "--json", str(out), *extra])
        assert args._run(args) == 0
        runs[name] = {r["name"]: r for r in json.loads(out.read_text())["formats"]}["int8"]
    assert runs["prebuilt"]["make_s"] == 0.0 < runs["own"]["make_s"]
    assert runs["prebuilt"]["kl"] == runs["own"]["kl"] and runs["prebuilt"]["top1"] == runs["own"]["top1"]
    capsys.readouterr()


@pytest.mark.parametrize("pair, message", [("int8", "want ROW=PATH"), ("int9=/tmp", "want ROW=PATH"),
                                           ("int8=/no/such/dir", "does not exist")])
def test_prebuilt_refuses_bad_pairs(pair, message, capsys):
    args = build_parser().parse_args(["quant-eval", "--model", str(STORIES_GGUF), "--only", "int8",
                                      "--prebuilt", pair])
    assert args._run(args) == 2
    assert message in capsys.readouterr().err
