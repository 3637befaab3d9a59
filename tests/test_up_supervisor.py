"""`pdserve up` as a supervisor, with real processes: a dead child is restarted with back-off while
the rest keep serving; children exit when their supervisor dies, even by SIGKILL; a taken port is
refused before anything starts. Every wait is a condition with a deadline."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from waiting import wait_until
from conftest import STORIES_GGUF
from test_up import _alive, _descendants, _free_port, _read_ready_line, _wait_gone

from pdserve import parent_watch
from pdserve.supervisor import ChildSpec, RestartPolicy, Supervisor
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
CHILD_EXIT_S = 20  # how long an orphan may take to notice its supervisor is gone (it needs ~1 s)


def _up(log: Path, *flags: str) -> subprocess.Popen:
    """`pdserve up` with one prefill and one decode worker on the test model; its stderr goes to `log`."""
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--model", str(STORIES_GGUF), "--threads", "1",
             "--grpc-port", str(_free_port()), "--http-port", "0", *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)


def _wait_log(proc: subprocess.Popen, log: Path, pattern: str, timeout_s: float = 120) -> re.Match:
    """The first match of `pattern` in up's log, once there; fails when up exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(pattern, log.read_text())
        if found:
            return found
        time.sleep(0.1)
    why = f"up exited with code {proc.returncode}" if proc.poll() is not None else f"{timeout_s:g} s passed"
    raise AssertionError(f"no {pattern!r} in up's log ({why}):\n{log.read_text()[-3000:]}")


def _generate(address: str, timeout_s: float = 120) -> gateway_pb2.GenerateResponse:
    """The last chunk of a 4-token greedy Generate, retried until the gateway answers it."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while True:
            try:
                return list(stub.Generate(gateway_pb2.GenerateRequest(
                    prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0)),
                    timeout=30))[-1]
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _child_pid(up_pid: int, command: str) -> int:
    """The pid of up's child running `pdserve <command>`, found through /proc (not up's own log)."""
    for pid in _descendants(up_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[1:4] == [b"-m", b"pdserve.cli", command.encode()]:
            return pid
    raise AssertionError(f"no child of up runs `pdserve {command}`")


def _stop(proc: subprocess.Popen, pids: set[int]) -> None:
    """Leave nothing behind, whatever the test found (a failing one may leave orphans)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_restart_policy_doubles_to_its_cap_and_resets_after_healthy_service() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=2.0, healthy_after_s=60)
    assert policy.next_delay(None, served_s=0) == 0.5
    assert [policy.next_delay(d, served_s=1) for d in (0.5, 1.0, 2.0)] == [1.0, 2.0, 2.0]
    assert policy.next_delay(2.0, served_s=60) == 0.5  # it had served long enough: a fresh start
    with pytest.raises(ValueError, match="first_delay_s <= max_delay_s"):
        RestartPolicy(first_delay_s=5, max_delay_s=1)


def test_a_child_that_keeps_crashing_is_retried_with_back_off(capfd: pytest.CaptureFixture) -> None:
    sup = Supervisor(grace_s=1, restart=RestartPolicy(first_delay_s=0.05, max_delay_s=0.2))
    sup.start(ChildSpec("crasher", "127.0.0.1:1", (sys.executable, "-c", "import sys; sys.exit(3)")))
    watcher = threading.Thread(target=sup.watch)
    watcher.start()
    try:
        wait_until(lambda: any(c.restarts >= 4 for c in sup.children), timeout_s=60)
    finally:
        sup.stop_requested = True
        watcher.join(timeout=10)
        sup.stop_all()
    err = capfd.readouterr().err
    for n, delay in ((1, 0.05), (2, 0.1), (3, 0.2), (4, 0.2)):
        assert re.search(rf"pdserve up: crasher \(127.0.0.1:1\) exited with code 3 [\d.]+ s after it started, "
                         rf"before it reported SERVING; restarting it in {delay:g} s \(restart {n}\)", err), err
    assert "restarted crasher (127.0.0.1:1) as pid " in err and not watcher.is_alive()


def test_up_restarts_a_killed_decode_worker_and_keeps_serving(tmp_path: Path) -> None:
    log = tmp_path / "up.log"
    proc = _up(log)
    pids: set[int] = set()
    try:
        ready = _read_ready_line(proc, timeout_s=180)
        grpc_address = re.search(r"grpc=(\S+)", ready).group(1)
        pids = _descendants(proc.pid)
        old = _child_pid(proc.pid, "decode")
        os.kill(old, signal.SIGKILL)
        _wait_log(proc, log, r"decode-0 \(\S+\) was killed by signal 9 after serving \d+ s; "
                       r"restarting it in 0.5 s \(restart 1\)")
        new = int(_wait_log(proc, log, r"restarted decode-0 \(\S+\) as pid (\d+)").group(1))
        pids.add(new)
        _wait_log(proc, log, r"decode-0 \(\S+\) is serving again after restart 1", timeout_s=180)
        last = _generate(grpc_address)
        assert last.finish_reason == "length" and last.usage.completion_tokens == 4
        assert proc.poll() is None and new != old and new in _descendants(proc.pid)
        assert re.search(rf"started decode-0 \(\S+\) as pid {old}\n", log.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a signal still stops it, and all of its children
        assert not _wait_gone(_descendants(proc.pid) | pids, timeout_s=CHILD_EXIT_S)
    finally:
        _stop(proc, pids)


def test_killing_up_leaves_no_orphans(tmp_path: Path) -> None:
    proc = _up(tmp_path / "up.log")
    pids: set[int] = set()
    try:
        _read_ready_line(proc, timeout_s=180)
        pids = _descendants(proc.pid)
        assert len(pids) == 4  # kvstore, prefill, decode, gateway
        proc.kill()
        proc.wait()
        assert not _wait_gone(pids, timeout_s=CHILD_EXIT_S)
    finally:
        _stop(proc, pids)


SUPERVISED_CHILD = ("from pdserve import parent_watch; parent_watch.arm(); "
                    "print('armed', flush=True); import time; time.sleep(120)")
# A supervisor that starts the child through the pipe alone (from a thread that then ends: PDEATHSIG
# would kill the child with that thread, so the supervisor must not ask for it there), or through
# PR_SET_PDEATHSIG alone; then it prints the child's pid and waits to be killed.
SUPERVISOR_SCRIPT = """
import subprocess, sys, threading, time
from pdserve import parent_watch
from pdserve.supervisor import ChildSpec, Supervisor
mode, child_code = sys.argv[1], sys.argv[2]
if mode == "pipe":
    sup, started = Supervisor(grace_s=1), []
    t = threading.Thread(target=lambda: started.append(sup.start(ChildSpec("c", "-", (sys.executable, "-c", child_code)))))
    t.start(); t.join()
    sys.path.insert(0, "tests")  # cwd is the repository: the tests' one wait helper
    from waiting import wait_until
    assert wait_until(lambda: "armed" in started[0].tail, 60), "the supervised child never armed"
    pid = started[0].proc.pid
else:
    env = {**__import__("os").environ, parent_watch.PID_ENV: str(__import__("os").getpid())}
    child = subprocess.Popen([sys.executable, "-c", child_code], env=env, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "armed\\n"
    pid = child.pid
time.sleep(0.5)  # the starting thread is gone by now: the child must still be there
print(pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["pipe", "pdeathsig"])
def test_a_child_exits_when_its_supervisor_is_killed(mode: str) -> None:
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT, mode, SUPERVISED_CHILD], cwd=REPO,
                           stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        child = int(sup.stdout.readline())
        assert _alive(child)
        sup.kill()
        sup.wait()
        assert not _wait_gone({child}, timeout_s=CHILD_EXIT_S)
    finally:
        _stop(sup, {child} if child else set())


def test_a_child_whose_supervisor_died_before_it_armed_exits_at_once() -> None:
    env = {**os.environ, parent_watch.PID_ENV: "1"}  # not its parent: that supervisor is gone
    done = subprocess.run([sys.executable, "-c", SUPERVISED_CHILD], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "its supervisor (pid 1) is gone already; exiting" in done.stderr


def _refusal(model: Path, *flags: str) -> subprocess.CompletedProcess:
    """`pdserve up` on `model`, a file that exists but is no model: if it did not refuse, it would
    fail at start-up (1), when its first worker cannot load it."""
    model.write_bytes(b"not a GGUF file")
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--model", str(model),
                           "--startup-timeout", "30", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_up_refuses_a_taken_port_with_one_line_naming_it_and_its_holder(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        grpc_taken = _refusal(tmp_path / "junk.gguf", "--grpc-port", str(port), "--http-port", "0")
        # the kvstore's metrics port is `port - 1`, the first prefill worker's the taken one
        metrics_taken = _refusal(tmp_path / "junk.gguf", "--grpc-port", str(_free_port()), "--http-port", "0",
                                 "--metrics-port-base", str(port - 1))
    assert grpc_taken.returncode == 2 and grpc_taken.stdout == ""
    assert grpc_taken.stderr == (f"pdserve up: cannot use --grpc-port {port} on 127.0.0.1: Address already in "
                                 f"use, held by pid {os.getpid()} ({Path('/proc/self/comm').read_text().strip()})\n")
    assert metrics_taken.returncode == 2 and metrics_taken.stdout == "", metrics_taken.stderr
    assert metrics_taken.stderr.startswith(
        f"pdserve up: cannot use port {port} (metrics of prefill-0, --metrics-port-base) on 0.0.0.0: "
        "Address already in use, held by pid ")
    assert metrics_taken.stderr.count("\n") == 1


def test_a_child_failing_at_start_up_still_fails_up_with_its_output(tmp_path: Path) -> None:
    done = _refusal(tmp_path / "junk.gguf", "--grpc-port", str(_free_port()), "--http-port", "0")
    assert done.returncode == 1 and done.stdout == ""
    assert re.search(r"pdserve up: (prefill|decode)-0 \(\S+\) exited with code \d+ while starting up; "
                     r"its last output:\n", done.stderr), done.stderr[-3000:]
    assert "restarting it" not in done.stderr


# A child serving grpc.health.v1 that says NOT_SERVING while the file argv[2] exists (as a worker
# whose engine failed does for good), SERVING otherwise.
NOT_SERVING_CHILD = """
import asyncio, os, sys, grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
async def main():
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(sys.argv[1])
    await server.start()
    while True:
        failed = os.path.exists(sys.argv[2])
        status = health_pb2.HealthCheckResponse.NOT_SERVING if failed else health_pb2.HealthCheckResponse.SERVING
        await servicer.set("", status)
        await asyncio.sleep(0.05)
asyncio.run(main())
"""


def test_a_child_answering_not_serving_is_killed_and_restarted(tmp_path: Path, capfd) -> None:
    address, flag = f"127.0.0.1:{_free_port()}", tmp_path / "engine-failed"
    spec = ChildSpec("failing", address, (sys.executable, "-c", NOT_SERVING_CHILD, address, str(flag)))
    sup = Supervisor(grace_s=1, restart=RestartPolicy(first_delay_s=0.05, not_serving_restart_s=0.5,
                                                      health_every_s=0.1))
    child = sup.start(spec)
    watcher = threading.Thread(target=sup.watch, daemon=True)
    try:
        assert sup.wait_serving([child], timeout_s=60)
        watcher.start()
        flag.touch()  # the child now answers NOT_SERVING
        child.proc.wait(timeout=60)  # killed by the supervisor, not by the test
        flag.unlink()
        wait_until(lambda: any(c.restarts == 1 and c.served_at for c in sup.children), timeout_s=60)
    finally:
        sup.stop_requested = True
        watcher.join(timeout=10)
        sup.stop_all()
    err = capfd.readouterr().err
    assert child.proc.returncode == -signal.SIGKILL
    assert re.search(r"failing \(\S+\) has answered NOT_SERVING for \d+ s; killing it to restart it", err), err
    assert "failing (%s) is serving again after restart 1" % address in err, err
