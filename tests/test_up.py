"""`pdserve up`: the supervisor on throwaway child processes, and the real stack started and
stopped by SIGTERM with no child left behind."""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from pdserve.cli import build_parser
from pdserve.commands.up import plan
from pdserve.ports import port_in_use
from pdserve.supervisor import ChildSpec, StartupError, Supervisor, describe_exit
from pdserve.healthcheck import is_serving
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pids: set[int], timeout_s: float = 5.0) -> list[int]:
    """The pids still alive after up to `timeout_s` (a SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`, found through the parent field of /proc/*/stat."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_plan_commands_parse() -> None:
    args = build_parser().parse_args(["up", "--prefill", "2", "--decode", "3", "--threads", "1"])
    workers, gateway = plan(args)
    assert [w.name for w in workers] == ["kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    for spec in [*workers, gateway]:
        assert spec.command[:3] == (sys.executable, "-m", "pdserve.cli")
        parsed = build_parser().parse_args(list(spec.command[3:]))
        assert parsed.bind == spec.address
    gw = build_parser().parse_args(list(gateway.command[3:]))
    assert gw.prefill == ",".join(w.address for w in workers[1:3]) and gw.bind == "127.0.0.1:50051"



def test_workers_of_one_up_share_the_hosts_cores(monkeypatch, tmp_path) -> None:
    """torch threads: the cores divided among every worker process; a worker's while no worker of the
    other kind computes: the cores divided among the workers of its kind only. Every worker gets the
    run directory's core share file, and a slot of its own among its kind."""
    from pdserve.runtime import compute_threads
    from pdserve.worker_config import WorkerConfig

    monkeypatch.setattr(compute_threads, "default_threads", lambda: 4)
    workers, _ = plan(build_parser().parse_args(["up", "--prefill", "2", "--decode", "2", "--run-dir", str(tmp_path)]))
    by_name = {w.name: build_parser().parse_args(list(w.command[3:])) for w in workers}
    decode, prefill = WorkerConfig.from_args(by_name["decode-1"], {}), WorkerConfig.from_args(by_name["prefill-1"], {})
    assert by_name["decode-1"].threads == 1 and decode.wide_threads == 2 and by_name["decode-1"].step_threads == 0
    assert decode.core_share == prefill.core_share == str(tmp_path / "cores")
    assert prefill.core_share_slot == decode.core_share_slot == 1 and prefill.wide_threads == 2
    workers, _ = plan(build_parser().parse_args(["up", "--prefill", "1", "--decode", "3", "--run-dir", str(tmp_path)]))
    by_name = {w.name: WorkerConfig.from_args(build_parser().parse_args(list(w.command[3:])), {}) for w in workers}
    assert (by_name["prefill-0"].wide_threads, by_name["decode-2"].wide_threads) == (4, 1)
    workers, _ = plan(build_parser().parse_args(["up", "--threads", "5", "--step-threads", "3"]))
    decode = build_parser().parse_args(list(workers[-1].command[3:]))
    assert (WorkerConfig.from_args(decode, {}).wide_threads, decode.step_threads) == (5, 3)  # never below --threads


def test_plan_passes_each_kind_its_degree_and_the_drain() -> None:
    """--tensor-parallel-size reaches both kinds, --decode-tensor-parallel-size and --speculative-ngram
    only decode workers;
    the workers' drain deadline is half the grace period unless --drain-timeout-s says."""
    args = build_parser().parse_args(["up", "--decode", "1", "--tensor-parallel-size", "3",
                                      "--decode-tensor-parallel-size", "1", "--grace-period", "8",
                                      "--speculative-ngram", "4", "--prefill-pipeline-parallel-size", "2"])
    workers, _ = plan(args)
    by_name = {w.name: (build_parser().parse_args(list(w.command[3:])), dict(w.env)) for w in workers}
    assert by_name["prefill-0"][0].tensor_parallel_size == 3 and by_name["decode-0"][0].tensor_parallel_size == 1
    assert by_name["decode-0"][0].speculative_ngram == 4 and by_name["prefill-0"][0].speculative_ngram == 0
    assert by_name["prefill-0"][0].pipeline_parallel_size == 2 and by_name["decode-0"][0].pipeline_parallel_size == 1
    assert by_name["decode-0"][1]["PDSERVE_DRAIN_TIMEOUT_S"] == "4"
    args = build_parser().parse_args(["up", "--drain-timeout-s", "0"])
    assert dict(plan(args)[0][-1].env)["PDSERVE_DRAIN_TIMEOUT_S"] == "0"


AB_CONFIG = """
[deployments.fp32]
model = "{model}"
prefill = 2
[deployments.f16]
model = "{model}"
kv_dtype = "float16"
num_blocks = 64
[experiments.ab]
arms = ["fp32", "f16"]
policy = "thompson"
"""


def test_plan_of_a_config_starts_every_deployment_and_one_gateway(tmp_path: Path) -> None:
    from conftest import STORIES_GGUF
    from gateway.experiments.serve_config import load_serve_config

    config = tmp_path / "ab.toml"
    config.write_text(AB_CONFIG.format(model=STORIES_GGUF))
    args = build_parser().parse_args(["up", "--config", str(config), "--decode", "1", "--num-blocks", "512",
                                      "--disagg-policy", "conditional"])
    workers, gateway = plan(args)
    assert [w.name for w in workers] == ["kvstore-fp32", "prefill-fp32-0", "prefill-fp32-1", "decode-fp32-0",
                                         "kvstore-f16", "prefill-f16-0", "decode-f16-0"]
    by_name = {w.name: build_parser().parse_args(list(w.command[3:])) for w in workers}
    assert by_name["decode-f16-0"].kv_dtype == "float16" and by_name["decode-f16-0"].num_blocks == 64
    assert by_name["prefill-fp32-1"].num_blocks == 512  # up's flag is the default
    assert by_name["decode-f16-0"].kvstore == workers[4].address  # each deployment its own kvstore
    gw = build_parser().parse_args(list(gateway.command[3:]))
    filled = load_serve_config(gw.config).with_targets(gw.deployment_targets)
    filled.require_targets()
    assert filled.deployments["fp32"].prefill_targets == (workers[1].address, workers[2].address)
    assert filled.deployments["f16"].kvstore_target == workers[4].address
    assert gw.disagg_policy == "conditional"  # up's placement flags reach the config's gateway too


def test_a_bad_config_is_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from conftest import STORIES_GGUF

    config = tmp_path / "bad.toml"
    config.write_text(AB_CONFIG.format(model=STORIES_GGUF).replace('policy = "thompson"', 'policy = "best"'))
    args = build_parser().parse_args(["up", "--config", str(config), "--grpc-port", str(_free_port())])
    assert args._run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdserve up: ") and "experiments.ab.policy: unknown policy 'best'" in err
    assert "\n" not in err
    # the gateway alone needs the workers' addresses for every deployment
    config.write_text(AB_CONFIG.format(model=STORIES_GGUF))
    args = build_parser().parse_args(["gateway", "--config", str(config), "--http-port", "0",
                                      "--deployment-targets", "fp32:prefill=127.0.0.1:1"])
    assert args._run(args) == 2
    assert "deployments.fp32.decode_targets: required by `pdserve gateway --config`" in capsys.readouterr().err
    args = build_parser().parse_args(["gateway", "--http-port", "0"])
    assert args._run(args) == 2
    assert "--prefill and --decode are required (or --config FILE" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-5", "nan"])
def test_a_negative_decode_yield_is_refused_before_anything_starts(value: str, capsys: pytest.CaptureFixture) -> None:
    """`up` forwards --decode-yield-ms to its decode workers, which refuse it below 0: `up` refuses it
    first, in one line, with nothing started (before, each decode worker failed its start)."""
    args = build_parser().parse_args(["up", "--decode-yield-ms", value, "--grpc-port", str(_free_port())])
    assert args._run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pdserve up: --decode-yield-ms must be >= 0 (0: never yield), got {float(value):g}"


def test_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_in_use("127.0.0.1", s.getsockname()[1]) == "Address already in use"
    assert port_in_use("127.0.0.1", _free_port()) is None


def test_free_port_never_hands_out_a_port_twice_in_one_process(monkeypatch) -> None:
    import pdserve.ports

    offers = iter([7100, 7100, 7101, 7100, 7101, 7102, 7103])

    class ScriptedSocket(socket.socket):  # the kernel, scripted to offer released ports again
        def getsockname(self):
            return ("127.0.0.1", next(offers))

    monkeypatch.setattr(pdserve.ports.socket, "socket", ScriptedSocket)
    monkeypatch.setattr(pdserve.ports, "_handed_out", set())
    assert [pdserve.ports.free_port(), pdserve.ports.free_port(), pdserve.ports.free_port(avoid=[7102])] == \
        [7100, 7101, 7103]


def test_plan_never_gives_two_children_one_port_even_when_the_kernel_repeats_one(monkeypatch) -> None:
    # The kernel may hand a just-released port out again (scripted here: it offers the gateway's
    # port and the kvstore's again); gRPC binds with SO_REUSEPORT, so a repeat would split one
    # port's connections between two servers silently (a gateway call answered "Method not found").
    import pdserve.ports

    offers = iter([7001, 7000, 7001, 7002, 7001, 7003] + list(range(7004, 7100)))

    class ScriptedSocket(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offers))

    monkeypatch.setattr(pdserve.ports.socket, "socket", ScriptedSocket)
    monkeypatch.setattr(pdserve.ports, "_handed_out", set())  # this test's ports only
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "2", "--grpc-port", "7000",
                                      "--http-port", "0"])
    workers, gateway = plan(args)
    ports = [int(spec.address.rsplit(":", 1)[1]) for spec in [*workers, gateway]]
    assert len(set(ports)) == len(ports) == 5, ports
    assert ports[:4] == [7001, 7002, 7003, 7004]  # the repeats were skipped, in order


def test_supervisor_reports_a_dead_child_and_kills_stubborn_ones() -> None:
    sup = Supervisor(grace_s=0.5)
    stubborn = _python("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                       "print('started', flush=True); time.sleep(60)")
    a = sup.start(ChildSpec("stubborn", "127.0.0.1:1", stubborn))
    b = sup.start(ChildSpec("crasher", "127.0.0.1:2", _python("import sys; print('boom'); sys.exit(3)")))
    try:
        assert sup.watch() is b
        assert describe_exit(b) == "crasher (127.0.0.1:2) exited with code 3" and list(b.tail) == ["boom"]
        deadline = time.monotonic() + 10
        while "started" not in a.tail and time.monotonic() < deadline:
            time.sleep(0.05)
        group = _descendants(a.proc.pid) | {a.proc.pid}
        assert len(group) == 2  # the stubborn child and its own child
    finally:
        start = time.monotonic()
        sup.stop_all()
    assert time.monotonic() - start < 5
    assert not _wait_gone(group)  # SIGKILL reached the whole process group


def test_supervisor_startup_timeout_names_the_child() -> None:
    sup = Supervisor(grace_s=1)
    port = _free_port()
    sup.start(ChildSpec("sleeper", f"127.0.0.1:{port}",
                        _python("import time; print('loading', flush=True); time.sleep(60)")))
    try:
        with pytest.raises(StartupError, match=rf"sleeper \(127.0.0.1:{port}\) did not report SERVING "
                                               r"within 1 s; its last output:\n    loading"):
            sup.wait_serving(sup.children, timeout_s=1)
    finally:
        sup.stop_all()


def _read_ready_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            assert line, f"pdserve up exited early with code {proc.wait()}"
            return line
    raise AssertionError("pdserve up did not print its ready line in time")


def test_up_serves_and_stops_cleanly_on_sigterm() -> None:
    port, http_port = _free_port(), _free_port()  # not 8000: concurrent test runs would collide
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--prefill", "1", "--decode", "1", "--threads", "1",
         "--grpc-port", str(port), "--http-port", str(http_port), "--grace-period", "10"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = _read_ready_line(proc, timeout_s=180)
        assert line.startswith(f"pdserve ready: grpc=127.0.0.1:{port} http=127.0.0.1:{http_port} prefill=[127.0.0.1:")
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as health:
            assert health.status == 200  # the HTTP API is up when the ready line is printed
        children = _descendants(proc.pid)
        assert len(children) == 4  # kvstore, prefill, decode, gateway
        assert is_serving(f"127.0.0.1:{port}")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            chunks = list(stub.Generate(gateway_pb2.GenerateRequest(
                prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0)),
                timeout=30))
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout.read() == ""  # exactly one line on stdout
        assert not [pid for pid in children if _alive(pid)]  # up waited for each of them
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_free_port_gives_up_with_a_clear_error_when_every_offer_was_handed_out(monkeypatch) -> None:
    import pdserve.ports

    class SameOfferSocket(socket.socket):  # a kernel that only ever offers one port
        def getsockname(self):
            return ("127.0.0.1", 7100)

    monkeypatch.setattr(pdserve.ports.socket, "socket", SameOfferSocket)
    monkeypatch.setattr(pdserve.ports, "_handed_out", {7100})
    monkeypatch.setattr(pdserve.ports, "_OFFERS_BEFORE_GIVING_UP", 5)
    with pytest.raises(OSError, match="ephemeral range is nearly used up"):
        pdserve.ports.free_port()
