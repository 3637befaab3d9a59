"""Worker processes run torch's parallel CPU ops on the engine thread alone (pdserve.runtime.compute_threads),
and `pdserve up` divides the cores among its worker processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pdserve.cli import build_parser
from pdserve.commands.up import worker_threads

THREAD_COUNTS = textwrap.dedent("""
    import threading, torch
    from pdserve.runtime import compute_threads

    claimed = compute_threads.one_thread_by_default(2)
    seen = {}

    def engine():
        compute_threads.claim(claimed)
        torch.ones(4).sum()  # a first op must not reset the claim (torch's per-thread lazy init)
        seen["engine"] = torch.get_num_threads()
        with compute_threads.one_thread():  # the sampler's draws (runtime/token_draw.py)
            seen["one_thread"] = torch.get_num_threads()
        seen["after_one_thread"] = torch.get_num_threads()

    def other():
        torch.ones(4).sum()
        seen["other"] = torch.get_num_threads()

    for target in (engine, other):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    seen["main"] = torch.get_num_threads()
    seen["loaded"] = compute_threads.run_claimed(claimed, torch.get_num_threads)
    try:
        compute_threads.run_claimed(claimed, int, "not a number")
    except ValueError as exc:
        seen["error"] = type(exc).__name__
    print(sorted(seen.items()))
""")


def test_only_the_claiming_thread_gets_more_than_one_torch_thread():
    # A subprocess: the process-wide count changes, which must not leak into the test process.
    out = subprocess.run([sys.executable, "-c", THREAD_COUNTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(sorted({"engine": 2, "other": 1, "main": 1, "loaded": 2,
                                             "error": "ValueError", "one_thread": 1,
                                             "after_one_thread": 2}.items()))


def _up(*flags: str):
    return build_parser().parse_args(["up", *flags])


@pytest.mark.parametrize("flags, cores, expected", [
    ((), 2, 1),  # 1 prefill + 1 decode on 2 cores
    ((), 8, 4),
    (("--decode", "3"), 8, 2),
    (("--decode-tensor-parallel-size", "2"), 8, 2),  # 1 prefill + 2 decode ranks
    (("--prefill", "2", "--decode", "2"), 2, 1),  # never 0
])
def test_up_divides_the_cores_among_its_worker_processes(flags, cores, expected):
    assert worker_threads(_up(*flags), cores) == expected
