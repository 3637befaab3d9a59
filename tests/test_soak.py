"""`pdserve soak` with tiny settings: 60 requests, some cancelled, one decode worker SIGKILLed and
restarted mid-load. What must hold whatever resume does: none lost or duplicated, streams equal
(or are prefixes of) the in-process engine's reference, only documented statuses, KV accounting."""

from __future__ import annotations

import json

from pdserve.cli import main


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
