"""Workers' step logs (`--step-log-dir` / PDSERVE_STEP_LOG_DIR) and their summary (`pdserve step-log`).

A real stack (stories260K, one prefill and one decode worker) writes them; the reference is what it
served: the prefill worker's steps hold every prompt token the gateway reported, the decode worker's
every generated token but each request's first (the prefill worker's)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.runtime.step_log import StepLog, StepRecord, read, summarize
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to see the big red ball"]
MAX_TOKENS = 9


def test_a_stacks_step_logs_hold_what_it_served(tmp_path):
    stack = start_stack(1, 1, env={"PDSERVE_STEP_LOG_DIR": str(tmp_path)})
    try:
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        usages = [list(stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(prompt=p, sampling=sampling),
                                                     timeout=120))[-1].usage for p in PROMPTS]
    finally:
        stack.stop()  # the engines stop, and their logs are written out
    prefill, decode = (read(next(tmp_path.glob(f"{kind}-*.jsonl"))) for kind in ("prefill", "decode"))
    assert sum(r.prompt_tokens for r in prefill) == sum(u.prompt_tokens for u in usages)
    assert sum(u.completion_tokens for u in usages) == len(PROMPTS) * MAX_TOKENS
    assert sum(r.decodes for r in decode) == len(PROMPTS) * (MAX_TOKENS - 1)
    assert sum(r.loads for r in decode) >= len(PROMPTS)  # each request's prompt KV, from the kvstore
    for r in prefill + decode:
        assert r.wall_ms > 0 and r.cpu_ms >= 0 and r.threads >= 1
    starts = [r.start_s for r in decode]
    assert starts == sorted(starts)


def _rec(start_s: float, wall_ms: float, decodes: int, prompt_tokens: int = 0, threads: int = 1) -> StepRecord:
    return StepRecord(start_s, wall_ms, wall_ms / 2, threads, decodes, prompt_tokens, 0)


def test_the_summary_groups_steps_by_batch_and_threads_and_measures_the_time_between_them():
    recs = [_rec(0.0, 100.0, 0, prompt_tokens=200), _rec(0.2, 10.0, 3), _rec(0.3, 30.0, 4),
            _rec(0.4, 20.0, 5, threads=2), _rec(0.5, 40.0, 8, threads=2), _rec(0.6, 40.0, 32, threads=2)]
    s = summarize(recs)
    assert s["steps"] == 6 and s["span_s"] == pytest.approx(0.64)
    assert s["in_steps_share"] == pytest.approx(0.240 / 0.64, abs=1e-3)
    assert s["decoded_tokens"] == 52 and s["prompt_tokens"] == 200
    groups = {(g["kind"], g["threads"]): g for g in s["groups"]}
    assert list(groups) == [("decode 1-4", 1), ("decode 5-8", 2), ("decode 29-32", 2), ("prompt", 1)]
    assert groups[("decode 1-4", 1)]["steps"] == 2 and groups[("decode 1-4", 1)]["mean_ms"] == 20.0
    assert groups[("decode 5-8", 2)]["median_ms"] == 30.0 and groups[("decode 5-8", 2)]["mean_decodes"] == 6.5
    assert groups[("prompt", 1)]["mean_prompt_tokens"] == 200.0
    assert summarize([]) == {"steps": 0}


def test_the_log_is_written_in_batches_and_read_back_whole(tmp_path):
    log = StepLog(tmp_path / "d" / "decode-1.jsonl")
    recs = [_rec(i * 0.1, 5.0, i % 7 + 1) for i in range(100)]
    for r in recs:
        log.record(r)
    assert len(read(log.path)) == 64  # FLUSH_EVERY so far
    log.close()
    assert read(log.path) == recs


def test_the_command_prints_a_table_and_says_what_is_wrong_with_a_file(tmp_path, capsys):
    path = tmp_path / "prefill-7.jsonl"
    log = StepLog(path)
    log.record(_rec(0.0, 50.0, 0, prompt_tokens=64))
    log.close()
    args = build_parser().parse_args(["step-log", str(path), "--json", str(tmp_path / "s.json")])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert "1 steps over 0.05 s" in out and "prompt" in out and (tmp_path / "s.json").exists()
    (tmp_path / "bad.jsonl").write_text('{"start_s": 1}\n')
    args = build_parser().parse_args(["step-log", str(tmp_path / "bad.jsonl")])
    with pytest.raises(SystemExit, match="pdserve step-log: .*missing"):
        args._run(args)


def test_a_log_that_cannot_be_written_stops_logging_without_raising(tmp_path, caplog):
    log = StepLog(tmp_path / "decode-3.jsonl")
    log.path.unlink()
    log.path.mkdir()  # the file's place taken: every write fails as a full disk's would
    for i in range(70):
        log.record(_rec(i * 0.1, 5.0, 1))
    log.close()
    assert log.failed and "no more steps are logged" in caplog.text
