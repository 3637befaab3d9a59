"""pdserve.thread_policy in a process of its own (the policy of a test process's threads would
outlive the test): threads present and threads started later run under SCHED_BATCH, an engine
thread and the OpenMP team it starts under SCHED_OTHER; "normal" changes nothing; "auto" is the
service's choice. (tests/test_stack.py checks a real stack's processes.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve import thread_policy
from pdserve.grpc_server import SERVICE_THREADS_ENV, ProcessConfig

CHILD = """
import json, os, threading
import torch
from pdserve import thread_policy

def policies():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        comm = open(f"/proc/self/task/{tid}/comm").read().strip()
        stat = open(f"/proc/self/task/{tid}/stat").read()
        out[tid] = [comm, int(stat.rsplit(")", 1)[1].split()[38])]
    return out

waiting = threading.Event()
before = threading.Thread(target=waiting.wait)  # a thread the process had before
before.start()
changed = thread_policy.apply(POLICY)
seen = {}

def engine():
    seen["started"] = os.sched_getscheduler(0)
    thread_policy.run_as_compute_thread()
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    (x @ x).sum()  # starts this thread's OpenMP team
    seen["threads"] = policies()

later = threading.Thread(target=engine)
later.start(); later.join()
waiting.set(); before.join()
print(json.dumps({"changed": changed, "main": os.sched_getscheduler(0), "started": seen["started"],
                  "before": seen["threads"].get(str(before.native_id)), "threads": seen["threads"]}))
"""


def _run(policy: str, started_batch: bool = False) -> dict:
    """What CHILD saw with `policy` applied; `started_batch`: the child starts under SCHED_BATCH, as a
    process that a batch thread starts does."""
    code = CHILD.replace("POLICY", repr(policy))
    start = (lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))) if started_batch else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         preexec_fn=start)
    return json.loads(out.stdout)


def test_batch_puts_service_threads_under_sched_batch_and_the_engine_team_under_the_default() -> None:
    got = _run("batch")
    assert got["changed"] >= 2  # the main thread and the one started before
    assert got["main"] == os.SCHED_BATCH
    assert got["before"][1] == os.SCHED_BATCH
    assert got["started"] == os.SCHED_BATCH  # a thread started later inherits the policy
    engine = [p for comm, p in got["threads"].values() if comm == thread_policy.COMPUTE_THREAD_NAME]
    others = [p for comm, p in got["threads"].values() if comm != thread_policy.COMPUTE_THREAD_NAME]
    assert len(engine) >= 2 and set(engine) == {os.SCHED_OTHER}  # the engine thread and its team
    assert set(others) == {os.SCHED_BATCH}


def test_normal_leaves_normal_threads_alone_and_still_names_the_engine_thread() -> None:
    got = _run("normal")
    assert got["changed"] == 0
    assert {p for _, p in got["threads"].values()} == {os.SCHED_OTHER}
    names = [comm for comm, _ in got["threads"].values()]
    assert names.count(thread_policy.COMPUTE_THREAD_NAME) >= 2  # the engine thread and its team


def test_normal_takes_a_process_started_under_batch_out_of_it() -> None:
    got = _run("normal", started_batch=True)
    assert got["changed"] >= 2  # the main thread and the one started before
    assert got["main"] == os.SCHED_OTHER and got["started"] == os.SCHED_OTHER
    assert {p for _, p in got["threads"].values()} == {os.SCHED_OTHER}


def test_auto_is_the_services_choice() -> None:
    assert thread_policy.resolve("auto", "batch") == "batch"
    assert thread_policy.resolve("auto", "normal") == "normal"
    assert thread_policy.resolve("normal", "batch") == "normal"
    assert ProcessConfig().service_threads == "auto"


def test_a_policy_it_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, batch, normal"):
        thread_policy.resolve("idle", "batch")
    with pytest.raises(ValueError, match="batch or normal"):
        thread_policy.apply("auto")
    with pytest.raises(ValueError, match=SERVICE_THREADS_ENV):
        ProcessConfig.from_env({SERVICE_THREADS_ENV: "fifo"})
