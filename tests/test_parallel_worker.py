"""Tensor-parallel workers in a real stack: a prefill worker at TP 2, decode workers at TP 2 and
TP 1, every block in the KV store in the canonical layout (all KV heads). Outputs equal the
in-process engine's greedy run; SIGKILL of one rank of the TP-2 decode worker mid-stream takes
that worker down (no rank left behind) and its streams complete on the TP-1 worker, from blocks
the TP-2 workers wrote."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.cli import build_parser
from pdserve.commands.up import plan
from pdserve.ports import free_port
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import Stack, start_planned
from pdserve.v1 import common_pb2, gateway_pb2
from waiting import wait_until

PROMPTS = (
    "Once upon a time, in a small town, there lived a kind old man who",
    "Lily and Ben went to the park to play with a ball. They",
    "The little dog was sad because it lost its red",
    "One day a big bird flew over the sea and saw a",
)
SHORT, LONG = 20, 600  # LONG: still mid-stream at the kill on a fast machine
READ_BEFORE_KILL = 48
TP2 = ("prefill-0", "decode-0")  # the workers started with --tensor-parallel-size 2


def start_tp_stack() -> Stack:
    """`start_stack(1, 2)` with prefill-0 and decode-0 at --tensor-parallel-size 2 (`pdserve up`
    has no per-role degree yet)."""
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--grpc-port", str(free_port()),
                                      "--threads", "1", "--http-port", "0", "--no-internal-token",
                                      "--disagg-policy", "always-remote"])
    workers, gateway = plan(args)
    workers = [replace(w, command=(*w.command, "--tensor-parallel-size", "2")) if w.name in TP2 else w
               for w in workers]
    return start_planned(workers, gateway, args)


@pytest.fixture(scope="module")
def stack():
    s = start_tp_stack()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(STORIES_GGUF)
    engine = Engine.from_checkpoint(checkpoint)
    prompts = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    out = {}
    for n in (SHORT, LONG):
        seqs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        out.update({(p, n): s.output_ids for p, s in zip(PROMPTS, seqs)})
    return out


def generate(stack, prompt: str, max_tokens: int):
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return stack.gateway_stub().Generate(request, timeout=120)


def tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def rank_pids(pid: int) -> list[int]:
    """The worker's child processes: its tensor-parallel ranks."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_tp2_prefill_and_decode_workers_equal_the_in_process_engine(stack, reference):
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: tokens(generate(stack, p, SHORT)), PROMPTS * 2))
    assert [r == reference[(p, SHORT)] for p, r in zip(PROMPTS * 2, results)] == [True] * 8
    for name in TP2:  # a prefill at TP 2 was read by decode workers of both degrees
        assert len(rank_pids(stack.child(name).proc.pid)) == 1
    assert stack.worker_stats("decode-0").kv_bytes_received > 0
    assert stack.worker_stats("decode-1").kv_bytes_received > 0


def test_a_killed_decode_rank_takes_its_worker_down_and_streams_finish_on_tp1(stack, reference):
    streams = [generate(stack, p, LONG) for p in PROMPTS]  # spread over both decode workers
    got: list[list[int]] = [[] for _ in streams]
    for out, stream in zip(got, streams):
        while len(out) < READ_BEFORE_KILL:
            out.extend(next(stream).token_ids)
    decode0 = stack.child("decode-0").proc
    assert stack.worker_stats("decode-0").num_running >= 1  # streams live on the worker we kill
    (rank1,) = rank_pids(decode0.pid)
    os.kill(rank1, signal.SIGKILL)
    for out, stream in zip(got, streams):
        out.extend(tokens(stream))  # no error: the gateway resumed the stream on decode-1
    assert [out == reference[(p, LONG)] for p, out in zip(PROMPTS, got)] == [True] * len(PROMPTS)
    assert wait_until(lambda: decode0.poll() is not None, timeout_s=30)  # the worker went down with its rank
