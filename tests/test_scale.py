"""`pdserve scale` against a real `pdserve up` (pdserve.scaler, pdserve.control): decode 1 -> 2 -> 1
under a steady greedy load that never fails and always equals the in-process engine; the new worker
gets requests, the removed one is stopped, not restarted; bad counts and a missing `up` are one line
and a non-zero exit; nothing is left running at the end. Every wait is a condition with a deadline."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from waiting import wait_until
from conftest import STORIES_GGUF
from test_up import _alive, _descendants, _free_port, _read_ready_line, _wait_gone
from test_membership import Load, greedy_reference
from test_up_supervisor import _stop, _wait_log

from pdserve.cli import main
from pdserve.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 180.0
CHILD_EXIT_S = 20


@dataclass
class Scaled:
    returncode: int
    stdout: str
    stderr: str


def _scale(capsys: pytest.CaptureFixture, run_dir: Path, *flags: str) -> Scaled:
    """`pdserve scale --run-dir RUN_DIR FLAGS`, run in this process (what the command does, without
    the seconds a fresh interpreter spends importing the CLI on a loaded machine)."""
    capsys.readouterr()
    code = main(["scale", "--run-dir", str(run_dir), *flags])
    out = capsys.readouterr()
    return Scaled(code, out.out, out.err)


def _decode_members(scaled: Scaled) -> list[str]:
    assert scaled.returncode == 0, scaled.stderr
    found = re.fullmatch(r"prefill=\[(\S+)\] decode=\[(\S+)\]\n", scaled.stdout)
    assert found, scaled.stdout
    return found.group(2).split(",")


def _steps(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.DecodeWorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=10).num_steps


def test_scale_decode_one_two_one_under_load(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "up.log"
    grpc_address = f"127.0.0.1:{_free_port()}"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", "--model", str(STORIES_GGUF), "--threads", "1",
             "--grpc-port", grpc_address.rsplit(":", 1)[1], "--http-port", "0", "--no-internal-token",
             "--run-dir", str(run_dir), "--max-workers", "4", "--grace-period", "10"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    pids: set[int] = set()
    load = None
    try:
        reference = greedy_reference()  # while up starts
        _read_ready_line(proc, timeout_s=WAIT_S)
        assert oct((run_dir / "control.sock").stat().st_mode & 0o777) == "0o600"
        assert oct(run_dir.stat().st_mode & 0o777) == "0o700"
        load = Load(grpc_address)
        first = _decode_members(_scale(capsys, run_dir))  # no counts: the membership, unchanged
        assert len(first) == 1

        grown = _decode_members(_scale(capsys, run_dir, "--decode", "2"))
        assert grown[0] == first[0] and len(grown) == 2
        pids = _descendants(proc.pid)
        steps = _steps(grown[1])
        assert wait_until(lambda: _steps(grown[1]) > steps, WAIT_S), "no request reached the new decode worker"
        bind = f"--bind\0{grown[1]}\0".encode()
        added = next(pid for pid in pids if bind in Path(f"/proc/{pid}/cmdline").read_bytes())

        assert _decode_members(_scale(capsys, run_dir, "--decode", "1")) == first  # the newest one leaves
        assert not _alive(added)  # answered once it is gone...
        _wait_log(proc, log, rf"decode-1 \({re.escape(grown[1])}\) stopped as asked \(exit code 0\)")
        done = load.done()
        assert wait_until(lambda: load.done() >= done + 4, WAIT_S)  # ...and not restarted: serving goes on
        assert "restarting it" not in log.read_text()

        for flags, why in ((("--decode", "0"), "--decode 0: need at least 1 worker"),
                           (("--decode", "5"), "--decode 5: must be 1 to 4 (up's --max-workers)")):
            refused = _scale(capsys, run_dir, *flags)
            assert (refused.returncode, refused.stdout) == (2, "") and refused.stderr == f"pdserve scale: {why}\n"
        proc.send_signal(signal.SIGUSR2)  # at one worker: refused, logged
        _wait_log(proc, log, r"SIGUSR2: not scaling: decode workers must stay within 1 to 4, not 0")
        load.stop()
        errors = [e for _, _, e in load.results if e]
        assert not errors, f"{len(errors)} of {len(load.results)} requests failed, e.g. {errors[0]}"
        assert all(got == reference[p] for p, got, _ in load.results), "an output differs from the in-process engine's"

        pids |= _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not _wait_gone(pids, timeout_s=CHILD_EXIT_S)
        assert not run_dir.exists()  # socket and list files removed
        missing = _scale(capsys, run_dir, "--decode", "2")
        assert missing.returncode == 1 and missing.stdout == "" and missing.stderr.count("\n") == 1
        assert missing.stderr.startswith("pdserve scale: no pdserve up runs here")
    finally:
        if load is not None:
            load.stop()
        _stop(proc, pids)


@pytest.mark.parametrize("mode", [0o755, None])
def test_a_run_dir_others_can_enter_or_not_mine_is_refused(tmp_path: Path, mode: int | None) -> None:
    from pdserve.control import ControlError, make_private_dir

    target = tmp_path / "run"
    if mode is None:
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")  # a symlink planted where the directory goes
    else:
        target.mkdir(mode=mode)
        target.chmod(mode)
    with pytest.raises(ControlError, match="open to other users" if mode else "not a directory"):
        make_private_dir(target)
