"""pdserve bench-stack: the in-process engine it compares against is built as the stack's workers
build theirs (same dtype, weight format, dense copy), and one tiny run of the command on a real
stack (stories260K)."""

from __future__ import annotations

import json

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.commands import bench_stack
from pdserve.engine_args import engine_config_from_args


def _worker_config(role: str, *flags: str):
    args = build_parser().parse_args([role, "--model", str(STORIES_GGUF), *flags])
    return engine_config_from_args(args)


def test_the_in_process_engine_is_configured_as_the_workers_are() -> None:
    """Its dtype, weight format and dense copy are the workers' for the same flags (it once ran
    EngineConfig()'s float32 against workers computing in bf16)."""
    for flags in ([], ["--dtype", "bfloat16"], ["--dtype", "float32", "--dense-copy", "off"],
                  ["--dtype", "bfloat16", "--int8-prompts", "off"]):
        args = build_parser().parse_args(["bench-stack", "--model", str(STORIES_GGUF), *flags])
        engine, _ = bench_stack.in_process_engine(args)
        prefill = _worker_config("prefill", *flags)
        for field in ("dtype", "weight_format", "dense_copy", "int8_prompts"):
            assert getattr(engine.config, field) == getattr(prefill, field), (flags, field)
        assert engine.config.cache.dtype == prefill.cache.dtype == _worker_config("decode", *flags).cache.dtype


def test_step_threads_reach_the_in_process_engine_and_the_stacks_decode_worker() -> None:
    """--step-threads is the thread-for-thread comparison's other half: the C step of both runs."""
    from pdserve.commands.up import plan

    args = build_parser().parse_args(["bench-stack", "--model", str(STORIES_GGUF), "--step-threads", "2"])
    engine, _ = bench_stack.in_process_engine(args)
    assert engine.config.step_threads == 2
    workers, _ = plan(build_parser().parse_args(["up", *bench_stack.engine_flags(args)]))
    decode = next(w for w in workers if w.name.startswith("decode"))
    cli = decode.command[decode.command.index("decode"):]
    assert engine_config_from_args(build_parser().parse_args(list(cli))).step_threads == 2


def test_tiny_run_on_a_real_stack(tmp_path) -> None:
    out = tmp_path / "stack.json"
    args = build_parser().parse_args([
        "bench-stack", "--model", str(STORIES_GGUF), "--num-requests", "6", "--concurrency", "3",
        "--prompt-len", "4", "8", "--output-len", "3", "6", "--engine-threads", "1", "--json", str(out)])
    assert args._run(args) == 0
    data = json.loads(out.read_text())
    local, remote = data["runs"]
    assert (local["name"], remote["name"]) == ("in-process", "disaggregated")
    assert local["requests"] == remote["requests"] == 6
    assert local["output_tokens"] == remote["output_tokens"]  # ignore_eos: every request its full length
    assert data["ratio"] == round(remote["output_tokens_per_s"] / local["output_tokens_per_s"], 2)
    assert (data["engine_threads"], data["stack_threads"]) == (1, 1)
    assert data["kv_bytes_per_request"] > 0 and data["cpu_seconds_during_run"]["decode-0"] > 0
