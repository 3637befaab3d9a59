"""What must hold on a quiet stack, whatever it went through: no KV leaked anywhere.

A worker's paged cache is quiet when nothing runs or waits and every block is free again
(WorkerStats.num_blocks_free counts the evictable cached blocks too, so free == total and
cached <= free: free-not-cached + cached == total). The kvstore is quiet when no block is pinned
and no lease is live, and it holds no more bytes than its capacity. Leases of requests whose
owner died expire after the kvstore's lease TTL, so callers poll (`wait_quiet`) instead of
checking once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from pdserve.stack import Stack


@dataclass(frozen=True, slots=True)
class KVCheck:
    """The KV accounting of one process: `problem` is "" when it holds."""

    name: str
    total: int  # blocks (workers) or capacity bytes (kvstore)
    free: int  # free blocks (cached included) or capacity - used bytes
    cached: int  # cached blocks (workers) or blocks held (kvstore)
    problem: str


def worker_check(stack: Stack, name: str) -> KVCheck:
    try:
        s = stack.worker_stats(name)
    except grpc.RpcError as err:
        return KVCheck(name, 0, 0, 0, f"Stats failed: {err.code().name}")
    problem = ""
    if s.num_running or s.num_waiting:
        problem = f"{s.num_running} running and {s.num_waiting} waiting sequences"
    elif s.num_blocks_free != s.num_blocks_total:
        problem = f"{s.num_blocks_total - s.num_blocks_free} of {s.num_blocks_total} blocks still referenced"
    elif not 0 <= s.num_blocks_cached <= s.num_blocks_free:
        problem = f"cached {s.num_blocks_cached} outside 0..free {s.num_blocks_free}"
    return KVCheck(name, s.num_blocks_total, s.num_blocks_free, s.num_blocks_cached, problem)


def kvstore_check(stack: Stack) -> KVCheck:
    try:
        s = stack.kvstore_stats()
    except grpc.RpcError as err:
        return KVCheck("kvstore", 0, 0, 0, f"Stats failed: {err.code().name}")
    problem = ""
    if s.num_pinned or s.num_leases:
        problem = f"{s.num_pinned} blocks pinned by {s.num_leases} live leases"
    elif not 0 <= s.used_bytes <= s.capacity_bytes:
        problem = f"used {s.used_bytes} bytes outside 0..capacity {s.capacity_bytes}"
    return KVCheck("kvstore", s.capacity_bytes, s.capacity_bytes - s.used_bytes, s.num_blocks, problem)


def kv_checks(stack: Stack) -> list[KVCheck]:
    """One check per worker and the kvstore, in the stack's order."""
    names = [c.spec.name for c in stack.workers if c.spec.name != "kvstore"]
    return [kvstore_check(stack), *(worker_check(stack, n) for n in names)]


def wait_quiet(stack: Stack, timeout_s: float = 30.0, poll_s: float = 0.2) -> list[KVCheck]:
    """Poll `kv_checks` until every one holds or `timeout_s` passes; the last checks."""
    deadline = time.monotonic() + timeout_s
    while True:
        checks = kv_checks(stack)
        if all(not c.problem for c in checks) or time.monotonic() > deadline:
            return checks
        time.sleep(poll_s)


def kv_problems(checks: list[KVCheck]) -> list[str]:
    return [f"{c.name}: {c.problem}" for c in checks if c.problem]


def rss_mib(pid: int) -> float | None:
    """Resident memory of a live process (VmRSS in /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def rss_by_child(stack: Stack) -> dict[str, tuple[int, float | None]]:
    """name -> (pid, RSS MiB) of every child; the pid tells a restarted child from the first one."""
    return {c.spec.name: (c.proc.pid, rss_mib(c.proc.pid)) for c in [*stack.workers, stack.gateway]}
