"""Membership that follows a list file (gateway.target_file, docs/kubernetes.md#membership), with real
processes: a gateway reading its decode workers from a file, under a steady load of greedy streams,
while decode workers are added to the file, one is removed from it and stopped, the file is broken
and goes missing. No request fails and every output equals the in-process engine's. Every wait is
a condition with a deadline."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import grpc
import pytest
import torch

from waiting import wait_until
from conftest import STORIES_GGUF
from gateway.target_file import TargetFile, parse_lines
from gateway.targets import Target, parse_target
from pdserve.membership import list_file, write_list_file
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = (
    "Once upon a time, in a small town, there lived a kind old man who",
    "Lily and Ben went to the park to play with a ball. They",
    "The little dog was sad because it lost its red",
    "One day a big bird flew over the sea and saw a",
)
TOKENS = 48  # short streams: many start and end while the membership changes
CLIENTS = 4
WAIT_S = 120.0  # generous: a worker loads in seconds, 4x slower is still far inside


def test_list_file_lines_bad_lines_and_a_missing_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "decode.targets"
    watched = TargetFile(str(path), "decode")
    assert watched.poll() == [] and "cannot read it" in watched.error  # missing from the start: nothing yet
    path.write_text("# decode workers\n127.0.0.1:5001\n\nnot a target\ndns:///decode:5002  # all of them\n"
                    "file:///elsewhere\n127.0.0.1:5001\n")
    with caplog.at_level(logging.WARNING, logger="gateway.target_file"):
        got = watched.poll()
    assert got == [Target("127.0.0.1", 5001), Target("decode", 5002, resolve_all=True)] and watched.error == ""
    assert f"decode list file {path} line 4: target 'not a target'" in caplog.text
    assert f"decode list file {path} line 6: target 'file:///elsewhere': a list file cannot name" in caplog.text
    path.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.target_file"):
        assert watched.poll() == got and watched.poll() == got  # the last good membership is kept
    assert caplog.text.count("keeping the last membership") == 1  # logged once, not every probe
    write_list_file(path, [])  # empty: a file being written, not "no workers"
    assert watched.poll() == got and "names no target" in watched.error
    write_list_file(path, ["127.0.0.1:5003"])
    assert watched.poll() == [Target("127.0.0.1", 5003)] and watched.error == ""
    assert parse_lines("[::1]:7\n")[0] == [parse_target("[::1]:7")]
    with pytest.raises(ValueError, match="file:///absolute/path"):
        parse_target("file:relative/path")


def test_a_pool_follows_its_list_file_and_keeps_a_removed_endpoint_until_its_calls_end(tmp_path: Path) -> None:
    from gateway.workers import WorkerPool

    path = tmp_path / "decode.targets"
    write_list_file(path, ["127.0.0.1:1", "127.0.0.1:2"])  # nothing listens: probes fail, membership holds

    async def scenario() -> None:
        pool = WorkerPool("decode", [parse_target(f"file://{path}"), parse_target("127.0.0.1:3")],
                          lambda channel: None, probe_interval_s=600, probe_timeout_s=0.2)
        await pool.refresh()
        assert [ep.address for ep in pool.endpoints] == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        busy = pool.by_address("127.0.0.1:2")
        with busy.track():  # a stream still running on it
            write_list_file(path, ["127.0.0.1:1"])
            await pool.refresh()
            assert [ep.address for ep in pool.endpoints] == ["127.0.0.1:1", "127.0.0.1:3"]
            assert pool._retiring == [busy]  # out of routing, its channel still open for the stream
        await pool.refresh()
        assert pool._retiring == []  # closed once its last call ended
        path.unlink()
        await pool.refresh()
        assert [ep.address for ep in pool.endpoints] == ["127.0.0.1:1", "127.0.0.1:3"]
        assert f"file://{path} (list file {path}: cannot read it (No such file or directory))" in pool.describe()
        await pool.close()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return greedy_reference()


def greedy_reference() -> dict[str, list[int]]:
    """{prompt: greedy output ids} of the in-process engine (tests/test_scale.py too)."""
    torch.set_num_threads(1)  # the stack's processes use the other cores
    checkpoint = load_checkpoint(STORIES_GGUF)
    engine = Engine.from_checkpoint(checkpoint)
    seqs = engine.generate([checkpoint.tokenizer.encode(p) for p in PROMPTS],
                           SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    return {p: s.output_ids for p, s in zip(PROMPTS, seqs)}


@pytest.fixture(scope="module")
def list_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lists")


@pytest.fixture(scope="module")
def stack(list_dir: Path):
    """kvstore, one prefill and three decode workers, the gateway reading its workers from `list_dir`
    where only decode-0 is left. (The spare two load with the rest, in parallel: a worker started
    later costs the suite its whole start-up; tests/test_scale.py starts one at run time.)"""
    s = start_stack(1, 3, "--model", str(STORIES_GGUF), "--max-batch-size", "32", list_dir=list_dir)
    try:
        write_list_file(list_file(list_dir, "decode"), [s.child("decode-0").spec.address])
        for name in ("decode-1", "decode-2"):
            left = f"decode worker {s.child(name).spec.address} left the pool"
            assert wait_until(lambda: _said(s.gateway.tail, left), WAIT_S), "\n".join(s.gateway.tail)
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


class Load:
    """CLIENTS threads sending greedy requests back to back until stopped; every result is kept."""

    def __init__(self, address: str) -> None:
        self.results: list[tuple[str, list[int], str]] = []  # (prompt, tokens, error or "")
        self.started = [0] * CLIENTS  # requests each client has sent (one at a time)
        self.finished = [0] * CLIENTS
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._channel = grpc.insecure_channel(address)
        stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._threads = [threading.Thread(target=self._loop, args=(stub, i), daemon=True) for i in range(CLIENTS)]
        for t in self._threads:
            t.start()

    def _loop(self, stub, i: int) -> None:
        while not self.stopping.is_set():
            self.started[i] += 1
            prompt, got, error = PROMPTS[i % len(PROMPTS)], [], ""
            request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
                max_tokens=TOKENS, temperature=0, ignore_eos=True))
            try:
                for chunk in stub.Generate(request, timeout=WAIT_S):
                    got.extend(chunk.token_ids)
            except grpc.RpcError as err:
                error = f"{err.code().name}: {err.details()}"
            with self.lock:
                self.results.append((prompt, got, error))
                self.finished[i] += 1

    def next_round(self) -> None:
        """Wait until every client has finished a request sent after now: whatever was in flight
        (picked by the gateway) before has ended."""
        sent = list(self.started)
        assert wait_until(lambda: all(f > s for f, s in zip(self.finished, sent)), WAIT_S), (sent, self.finished)

    def done(self) -> int:
        with self.lock:
            return len(self.results)

    def stop(self) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=WAIT_S)
        self._channel.close()


def _steps(stack, name: str) -> int:
    return stack.worker_stats(name).num_steps


def _said(lines: list[str], text: str) -> bool:
    return any(text in line for line in list(lines))


def test_decode_workers_join_and_leave_through_the_list_file(stack, list_dir, reference) -> None:
    gateway_lines: list[str] = []
    stack.gateway.listeners.append(gateway_lines.append)  # every line the gateway logs from now on
    path = list_file(list_dir, "decode")
    first, new = stack.child("decode-0"), [stack.child("decode-1"), stack.child("decode-2")]
    load = Load(stack.gateway_address)
    try:
        assert wait_until(lambda: load.done() >= CLIENTS, WAIT_S)  # the load runs on decode-0 alone
        members = [first.spec.address]
        for child in new:  # one at a time: each is seen to get work before the next joins
            before = _steps(stack, child.spec.name)
            members.append(child.spec.address)
            write_list_file(path, [*members, "not-a-target"])  # a bad line does not stop the others
            assert wait_until(lambda: _steps(stack, child.spec.name) > before, WAIT_S), \
                f"no request reached {child.spec.name} after it joined the list file"
        assert wait_until(lambda: _said(gateway_lines, f"decode list file {path} line 3: target 'not-a-target'"))

        leaving = new[0]  # out of the file: its running streams end there, nothing new comes
        write_list_file(path, [first.spec.address, new[1].spec.address])
        assert wait_until(lambda: _said(gateway_lines, f"decode worker {leaving.spec.address} left the pool"), WAIT_S)
        load.next_round()  # the requests picked before it left have ended (on it or elsewhere)...
        steps = _steps(stack, leaving.spec.name)
        load.next_round()  # ...and a round of requests later...
        assert _steps(stack, leaving.spec.name) == steps  # ...none of them reached the removed worker
        assert stack.worker_stats(leaving.spec.name).num_running == 0
        stack.supervisor.retire(leaving.spec.name)  # SIGTERM, an expected exit
        assert leaving.proc.wait(timeout=WAIT_S) == 0

        path.rename(path.with_suffix(".away"))  # a missing file keeps the last membership
        assert wait_until(lambda: _said(gateway_lines, "cannot read it"), WAIT_S)
        done = load.done()
        assert wait_until(lambda: load.done() >= done + 2 * CLIENTS, WAIT_S)
        steps = {c.spec.name: _steps(stack, c.spec.name) for c in (first, new[1])}
        assert wait_until(lambda: all(_steps(stack, n) > s for n, s in steps.items()), WAIT_S)  # both still used
        path.with_suffix(".away").rename(path)
    finally:
        load.stop()
    errors = [e for _, _, e in load.results if e]
    assert not errors, f"{len(errors)} of {len(load.results)} requests failed, e.g. {errors[0]}"
    wrong = [p for p, got, _ in load.results if got != reference[p]]
    assert not wrong, f"{len(wrong)} of {len(load.results)} outputs differ from the in-process engine's"
