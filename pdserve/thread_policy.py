"""Which of a service process's threads the kernel may interrupt for which: SCHED_BATCH for the
gateway's and the kvstore's threads (gRPC's, asyncio's, their executors'), the ordinary SCHED_OTHER
for the workers, whose engine threads (and the OpenMP teams they start) do the computing.

Why. A worker's engine steps on an OpenMP team (two threads on two cores), whose members meet at a
barrier after each phase of a step (kernels/cpu/decode_step.c). The service threads of the host's
other processes wake up once or more a token, and under the default policy a thread that wakes
preempts the one running on its core at once: a team member is put aside for a fraction of a
millisecond, and its partner waits for it at the next barrier. A SCHED_BATCH thread that wakes does
not preempt: it runs when a core comes free (a team member asleep at a barrier, an engine between
steps) or at the scheduler's next tick, and a burst of messages is then handled in one wake-up rather
than one each. Nothing is lowered: the nice value stays, so these threads keep their fair share of
the CPU; only when they take it changes. SmolLM2 through the stack on 2 cores, bench-stack's default
workload (32 streams, answers of 16-256 tokens), six alternating pairs: +1 to +19 % tok/s (679.5 / 606.9
/ 662.8 / 700.8 / 665.2 / 605.5 against 587.5 / 509.1 / 568.2 / 633.1 / 646.6 / 601.6); the gateway's
CPU 3.4-4.4 against 4.4-6.1 s, the client's 1.3-1.7 against 1.8-2.3 (more messages a wake-up);
200-token prompts and one stream unchanged within the noise. A worker's own service threads stay
normal by default (`resolve`). Linux lets any process switch between these two policies (no
privilege); elsewhere nothing changes.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

# --service-threads: auto (the service's own choice, `resolve`), SCHED_BATCH for service threads, or none
POLICIES = ("auto", "batch", "normal")
COMPUTE_THREAD_NAME = "pdserve-engine"
_SCHED = {"batch": getattr(os, "SCHED_BATCH", None), "normal": getattr(os, "SCHED_OTHER", None)}


def resolve(policy: str, service_default: str) -> str:
    """`policy` with "auto" replaced by the service's default: "batch" for the gateway and the kvstore,
    whose threads are all service threads, "normal" for a worker. Why not batch in a worker too: its
    service threads share the interpreter lock with the engine thread, and one that holds it while
    the engine's team has both cores leaves the engine waiting for it; one stream through the stack
    was 5-10 % slower that way (five alternating pairs), 32 streams no faster."""
    if policy not in POLICIES:
        raise ValueError(f"service thread policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return service_default if policy == "auto" else policy


def supported() -> bool:
    return hasattr(os, "sched_setscheduler") and os.path.isdir("/proc/self/task")


def apply(policy: str) -> int:
    """Put every thread this process has now under `policy`, "batch" or "normal" (threads it starts
    later inherit it from the thread that starts them); the number of threads changed."""
    if policy not in POLICIES[1:]:
        raise ValueError(f"a thread policy to apply is batch or normal, got {policy!r}")
    if not supported():
        return 0
    return sum(_switch(int(tid), policy) for tid in os.listdir("/proc/self/task"))


def run_as_compute_thread(name: str = COMPUTE_THREAD_NAME) -> None:
    """An engine thread's start: named `name` in the kernel (`top -H`, /proc/PID/task/TID/comm), and
    under SCHED_OTHER if it inherited SCHED_BATCH. The OpenMP team it starts afterwards inherits both."""
    if not supported():
        return
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])  # the kernel keeps 15 bytes
    except OSError as err:
        log.debug("the engine thread keeps its name: %s", err)
    _switch(0, "normal")


def _switch(tid: int, policy: str) -> bool:
    """Thread `tid` (0: the calling one) under `policy`; whether it changed. "normal" moves only a
    SCHED_BATCH thread: a process a batch thread started inherits that policy, while one someone
    chose otherwise (real-time, idle) stays."""
    try:
        if policy == "normal" and os.sched_getscheduler(tid) != _SCHED["batch"]:
            return False
        os.sched_setscheduler(tid, _SCHED[policy], os.sched_param(0))
        return True
    except OSError as err:  # the thread ended meanwhile, or a policy this process may not leave
        log.debug("thread %s keeps its scheduling policy: %s", tid or "(this one)", err)
        return False
