"""`pdserve soak` with tiny settings: 60 requests, some cancelled, one decode worker SIGKILLed and
restarted mid-load. What must hold whatever resume does: none lost or duplicated, streams equal
(or are prefixes of) the in-process engine's reference, only documented statuses, KV accounting."""

from __future__ import annotations

import json
import random
import time

import pytest

from pdserve.cli import main
from pdserve.soak.faults import Fault, FaultRunner, parse_faults, random_schedule


def test_soak_with_a_decode_kill_keeps_the_invariants(tmp_path, capsys):
    report_path = tmp_path / "soak.json"
    code = main(["soak", "--prefill", "1", "--requests", "60", "--concurrency", "6", "--cancel-rate", "0.2",
                 "--faults", "kill:decode-0@1s,restart:decode-0@3s", "--quiet-timeout-s", "30",
                 "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    table = capsys.readouterr().out
    assert code == 0, table
    assert report["sent"] == report["outcomes"] == 60
    assert report["invariants"] and all(report["invariants"].values()), table
    assert report["faults"][0]["target"] == "decode-0" and not report["faults"][0]["error"]
    assert report["completed_exact"] > 0 and report["by_status"].get("CANCELLED", 0) > 0
    assert "[PASS] none lost, none duplicated" in table


def test_fault_schedule_parses_and_refuses_with_the_item():
    assert parse_faults("restart:decode-0@15s, kill:decode-0@10") == [
        Fault(10.0, "kill", "decode-0"), Fault(15.0, "restart", "decode-0")]
    with pytest.raises(ValueError, match="'stop:decode-0@1s'"):
        parse_faults("kill:decode-0@1s,stop:decode-0@1s")


def test_random_schedule_restarts_every_kill():
    faults = random_schedule(10, 65, ["decode-0", "kvstore"], random.Random(0), down_s=3)
    assert [f.at_s for f in faults] == [10, 13, 20, 23, 30, 33, 40, 43, 50, 53, 60, 63]
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
