"""`pdserve soak` with tiny settings: 60 requests, some cancelled, one decode worker SIGKILLed and
restarted mid-load, a burst cancelled during prefill, forged KV blocks. What must hold whatever
resume does: none lost or duplicated, streams equal (or are prefixes of) the in-process engine's
reference, only documented statuses, KV accounting. Faults fire on progress (requests ended), so
the test means the same on a machine 4x faster or slower."""

from __future__ import annotations

import json
import random
import time

import pytest

from pdserve.cli import main
from pdserve.soak.faults import Fault, FaultRunner, Progress, due, parse_faults, random_schedule


def test_soak_with_a_decode_kill_keeps_the_invariants(tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    faults = "cancel-during-prefill@5r,poison@8r,kill:decode-0@10r,restart:decode-0@+5r"  # on progress, not time
    code = main(["soak", "--prefill", "1", "--requests", "60", "--concurrency", "6", "--cancel-rate", "0.2",
                 "--faults", faults, "--quiet-timeout-s", "30", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    table = capsys.readouterr().out
    assert code == 0, table
    # The load, one burst of 6 cancelled during prefill, 3 requests after the forged blocks.
    assert report["sent"] == report["outcomes"] == 60 + 6 + 3
    assert report["invariants"] and all(report["invariants"].values()), table
    cancels, poison, kill, restart = report["faults"]
    assert kill["fault"] == "kill:decode-0@10r" and not kill["error"] and not restart["error"]
    assert kill["in_flight"] > 0, "the kill must hit a live load"  # 50 requests were still to go
    assert cancels["action"] == "cancel-during-prefill" and not cancels["error"]
    assert report["by_kind"]["prefill-cancel"] == report["attacks"]["prefill_cancels"] == 6
    assert poison["action"] == "poison" and not poison["error"]
    assert report["attacks"]["forged_stored"] > 0 and report["by_kind"]["poison"] == 3
    assert not report["wrong_by_kind"], table  # forged KV never reached an output (the KV MAC)
    assert report["completed_exact"] > 0 and report["by_status"].get("CANCELLED", 0) > 0
    assert "[PASS] none lost, none duplicated" in table


def test_fault_schedule_parses_and_refuses_with_the_item():
    assert parse_faults("restart:decode-0@15s, kill:decode-0@10") == [
        Fault(10.0, "kill", "decode-0"), Fault(15.0, "restart", "decode-0")]
    assert parse_faults("kill:decode-0@20r,restart:decode-0@+2s,poison@500t,cancel-during-prefill@+3r") == [
        Fault(20, "kill", "decode-0", "r"), Fault(2, "restart", "decode-0", "s", relative=True),
        Fault(500, "poison", "", "t"), Fault(3, "cancel-during-prefill", "", "r", relative=True)]  # written order
    with pytest.raises(ValueError, match="'stop:decode-0@1s'"):
        parse_faults("kill:decode-0@1s,stop:decode-0@1s")
    with pytest.raises(ValueError, match="'kill@1r'.*needs a target"):
        parse_faults("kill@1r")
    with pytest.raises(ValueError, match="'poison:kvstore@1r'.*takes no target"):
        parse_faults("poison:kvstore@1r")
    with pytest.raises(ValueError, match="'kill:decode-0@3x'"):
        parse_faults("kill:decode-0@3x")


def test_random_schedule_restarts_every_kill():
    faults = random_schedule(10, 65, ["decode-0", "kvstore"], random.Random(0), down_s=3)
    assert [f.at for f in faults] == [10, 13, 20, 23, 30, 33, 40, 43, 50, 53, 60, 63]
    kills, restarts = faults[::2], faults[1::2]
    assert all(k.action == "kill" and r.action == "restart" and k.target == r.target for k, r in zip(kills, restarts))


def test_fault_runner_keeps_the_gap_after_a_slow_restart():
    def apply(fault: Fault) -> None:
        if fault.action == "restart":
            time.sleep(0.3)  # slower than the 0.1 s gap to the next kill
    runner = FaultRunner(parse_faults("kill:a@0s,restart:a@0.1s,kill:b@0.2s"), apply).start()
    runner.wait(timeout_s=10)
    restart, kill_b = runner.events[1], runner.events[2]
    assert kill_b.started_s >= restart.ended_s + 0.1 - 0.01


def test_progress_triggers_wait_for_requests_not_time():
    """A fault at 3r runs once 3 requests ended, however long that takes, and records the requests in
    flight; one at +2r after the previous fault's end; one the load never reaches is reported."""
    progress = Progress()
    seen: list[tuple[str, int]] = []
    runner = FaultRunner(parse_faults("kill:a@3r,restart:a@+2r,kill:b@100r"),
                         lambda f: seen.append((str(f), progress.ended)), progress).start()
    for _ in range(4):
        progress.request_started()
    assert not seen
    for _ in range(3):
        progress.request_ended()
    _wait_for(lambda: len(seen) == 1)
    assert seen == [("kill:a@3r", 3)] and runner.events[0].in_flight == 1
    for _ in range(2):
        progress.request_started()
        progress.request_ended()
    _wait_for(lambda: len(seen) == 2)
    assert seen[1] == ("restart:a@+2r", 5)
    runner.stop()
    assert [str(f) for f in runner.not_run] == ["kill:b@100r"]


def test_due_keeps_the_gap_in_its_own_unit():
    kill, restart = Fault(20, "kill", "a", "r"), Fault(30, "restart", "a", "r")
    assert due(kill, None, {"s": 0, "r": 0, "t": 0}) == 20
    assert due(restart, kill, {"s": 5, "r": 26, "t": 0}) == 36  # 10 requests after the kill ended
    assert due(Fault(4, "kill", "b", "s"), restart, {"s": 5, "r": 40, "t": 0}) == 4  # another unit: absolute
    assert due(Fault(2, "kill", "b", "t", relative=True), restart, {"s": 5, "r": 40, "t": 100}) == 102


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)
