"""The soak's fault schedule: which process to SIGKILL or restart, and when.

A schedule is written `kill:decode-0@10s,restart:decode-0@15s,kill:redis@20s,...` (`--faults`) or
drawn at random (`--fault-every-s`): every N seconds one target (a decode or prefill worker, the
kvstore, Redis) is killed and restarted `down_s` later. `FaultRunner` plays it on its own thread
against the stack, keeping each scheduled gap after the previous fault *ended* (a restart waits
until the process serves, which can take longer than the gap); each event records when it ran
and whether it worked, so the report can say which requests overlapped a fault window.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ACTIONS = ("kill", "restart")
_FAULT = re.compile(r"^(kill|restart):([\w.-]+)@(\d+(?:\.\d+)?)s?$")


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the load starts
    action: str  # "kill" (SIGKILL) or "restart" (start again, wait until it serves)
    target: str  # a child's name ("decode-0", "kvstore") or "redis"


@dataclass(slots=True)
class FaultEvent:
    fault: Fault
    started_s: float
    ended_s: float
    error: str = ""  # why it failed, "" when it worked


def parse_faults(text: str) -> list[Fault]:
    """`kill:decode-0@10s,restart:decode-0@15s`; ValueError naming the bad item."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        m = _FAULT.match(item)
        if not m:
            raise ValueError(f"bad fault {item!r}: write ACTION:TARGET@SECONDS, e.g. kill:decode-0@10s "
                             f"(actions: {', '.join(ACTIONS)})")
        faults.append(Fault(float(m[3]), m[1], m[2]))
    return sorted(faults, key=lambda f: f.at_s)


def random_schedule(every_s: float, duration_s: float, targets: Sequence[str], rng: random.Random,
                    down_s: float = 3.0) -> list[Fault]:
    """One kill every `every_s` seconds (from `every_s` on) of a random target, restarted `down_s` later."""
    faults: list[Fault] = []
    t = every_s
    while t + down_s < duration_s:
        target = rng.choice(list(targets))
        faults += [Fault(t, "kill", target), Fault(t + down_s, "restart", target)]
        t += every_s
    return faults


@dataclass
class FaultRunner:
    """Plays `faults` on a thread: `apply(fault)` does the work (kill or restart)."""

    faults: list[Fault]
    apply: Callable[[Fault], None]
    events: list[FaultEvent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> FaultRunner:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        prev_at, prev_end = 0.0, 0.0
        for fault in self.faults:
            # A restart can take many seconds: keep at least the scheduled gap after the previous
            # fault ended, so that a process gets its time up before the next kill.
            due = max(fault.at_s, prev_end + fault.at_s - prev_at)
            if self._stop.wait(max(self._t0 + due - time.monotonic(), 0)):
                return
            started = time.monotonic() - self._t0
            try:
                self.apply(fault)
                error = ""
            except Exception as err:  # noqa: BLE001 - reported as a failed fault, the soak goes on
                error = f"{type(err).__name__}: {err}"
            prev_at, prev_end = fault.at_s, time.monotonic() - self._t0
            self.events.append(FaultEvent(fault, started, prev_end, error))

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every fault has been played."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stop(self) -> None:
        """Skip the faults not yet due and wait for the one running (a restart) to end."""
        self._stop.set()
        self.wait()
