"""The soak's fault schedule: what to do (SIGKILL or restart a process, cancel requests during their
prefill, forge KV blocks) and when.

A schedule is written `kill:decode-0@20r,restart:decode-0@+10r,cancel-during-prefill@40r,poison@60r`
(`--faults`) or drawn at random (`--fault-every-s`). A trigger is either time or progress, so
that a schedule means the same on a machine 4x faster or slower:

    @10s    10 s after the load started          @+2s    2 s after the previous fault ended
    @20r    once 20 requests have ended          @+10r   10 more requests after the previous fault
    @500t   once 500 tokens have been streamed   @+200t  200 more tokens after the previous fault

`Progress` counts requests started and ended and tokens streamed (the workload updates it);
`FaultRunner` plays the schedule on its own thread, waiting on that counter's condition, never on
a timer sized for one machine. It keeps each scheduled gap after the previous fault *ended* (a
restart waits until the process serves, which can take longer than the gap). Each event records
when it ran, how many requests were in flight then, and whether it worked, so the report can say
which requests overlapped a fault window and that a fault hit a live load.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PROCESS_ACTIONS = ("kill", "restart")  # take a target: a child's name or "redis"
LOAD_ACTIONS = ("cancel-during-prefill", "poison")  # act on the load itself: no target
ACTIONS = (*PROCESS_ACTIONS, *LOAD_ACTIONS)
UNITS = {"s": "seconds", "r": "requests ended", "t": "tokens streamed"}
_FAULT = re.compile(r"^(?P<action>[a-z-]+)(?::(?P<target>[\w.-]+))?@(?P<rel>\+?)(?P<at>\d+(?:\.\d+)?)(?P<unit>[srt]?)$")


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # when, in `unit`s (after the load started, or after the previous fault when relative)
    action: str  # "kill" (SIGKILL), "restart" (start again, wait until it serves), or a LOAD_ACTION
    target: str = ""  # a child's name ("decode-0", "kvstore") or "redis"; "" for a load action
    unit: str = "s"  # "s" seconds, "r" requests ended, "t" tokens streamed
    relative: bool = False  # counted from the end of the previous fault

    def __str__(self) -> str:
        head = f"{self.action}:{self.target}" if self.target else self.action
        return f"{head}@{'+' if self.relative else ''}{self.at:g}{self.unit}"


@dataclass(slots=True)
class FaultEvent:
    fault: Fault
    started_s: float
    ended_s: float
    in_flight: int  # requests in flight when it started
    error: str = ""  # why it failed, "" when it worked


def parse_faults(text: str) -> list[Fault]:
    """`kill:decode-0@10s,restart:decode-0@+5r`; ValueError naming the bad item.

    A schedule of absolute triggers in one unit is sorted by time; any other is played in the
    written order (a relative trigger, or a mix of units, has no meaning out of order)."""
    faults = [_parse_one(item) for item in filter(None, (part.strip() for part in text.split(",")))]
    if len({f.unit for f in faults}) <= 1 and not any(f.relative for f in faults):
        faults.sort(key=lambda f: f.at)
    return faults


def _parse_one(item: str) -> Fault:
    m = _FAULT.match(item)
    usage = (f"write ACTION:TARGET@WHEN (e.g. kill:decode-0@10s, restart:decode-0@+20r) or LOAD_ACTION@WHEN "
             f"(e.g. poison@500t); actions: {', '.join(ACTIONS)}; WHEN: N or +N (after the previous fault), then "
             + ", ".join(f"{u} ({what})" for u, what in UNITS.items()))
    if not m or m["action"] not in ACTIONS:
        raise ValueError(f"bad fault {item!r}: {usage}")
    target = m["target"] or ""
    if (m["action"] in PROCESS_ACTIONS) != bool(target):
        need = "needs a target" if m["action"] in PROCESS_ACTIONS else "takes no target"
        raise ValueError(f"bad fault {item!r}: {m['action']} {need}; {usage}")
    return Fault(float(m["at"]), m["action"], target, m["unit"] or "s", bool(m["rel"]))


def random_schedule(every_s: float, duration_s: float, targets: Sequence[str], rng: random.Random,
                    down_s: float = 3.0) -> list[Fault]:
    """One fault every `every_s` seconds (from `every_s` on) of a random target: a process is killed
    and restarted `down_s` later; a load action (a target named like one) runs once."""
    faults: list[Fault] = []
    t = every_s
    while t + down_s < duration_s:
        target = rng.choice(list(targets))
        if target in LOAD_ACTIONS:
            faults.append(Fault(t, target))
        else:
            faults += [Fault(t, "kill", target), Fault(t + down_s, "restart", target)]
        t += every_s
    return faults


class Progress:
    """How far the load is: requests started and ended, tokens streamed, under one Condition that
    the fault runner waits on. Thread-safe; the workload's client threads update it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._t0 = time.monotonic()
        self.started = 0
        self.ended = 0
        self.tokens = 0

    def restart_clock(self) -> None:
        """The load starts now: seconds count from here."""
        with self._cond:
            self._t0 = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self.started - self.ended

    def value(self, unit: str) -> float:
        """Progress in `unit` ("s", "r" or "t")."""
        with self._cond:
            return {"s": self.elapsed_s(), "r": self.ended, "t": self.tokens}[unit]

    def request_started(self) -> None:
        self._bump("started", 1)

    def request_ended(self) -> None:
        self._bump("ended", 1)

    def add_tokens(self, n: int) -> None:
        if n:
            self._bump("tokens", n)

    def _bump(self, name: str, n: int) -> None:
        with self._cond:
            setattr(self, name, getattr(self, name) + n)
            self._cond.notify_all()

    def wait_until(self, unit: str, target: float, stop: threading.Event, poll_s: float = 0.5) -> bool:
        """Block until progress in `unit` reaches `target`; False when `stop` was set first. Wakes on
        every update; `poll_s` only bounds how late a time trigger or a stop is seen."""
        with self._cond:
            while not stop.is_set():
                now = self.value(unit)
                if now >= target:
                    return True
                wait = min(poll_s, target - now) if unit == "s" else poll_s
                self._cond.wait(wait)
        return False

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


@dataclass
class FaultRunner:
    """Plays `faults` on a thread against `progress`: `apply(fault)` does the work."""

    faults: list[Fault]
    apply: Callable[[Fault], None]
    progress: Progress = field(default_factory=Progress)
    events: list[FaultEvent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> FaultRunner:
        self.progress.restart_clock()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        prev: Fault | None = None
        at_prev_end = {unit: 0.0 for unit in UNITS}  # progress in each unit when the previous fault ended
        for fault in self.faults:
            if not self.progress.wait_until(fault.unit, due(fault, prev, at_prev_end), self._stop):
                return
            self._play(fault)
            prev, at_prev_end = fault, {unit: self.progress.value(unit) for unit in UNITS}

    def _play(self, fault: Fault) -> None:
        in_flight, started = self.progress.in_flight, self.progress.elapsed_s()
        try:
            self.apply(fault)
            error = ""
        except Exception as err:  # noqa: BLE001 - reported as a failed fault, the soak goes on
            error = f"{type(err).__name__}: {err}"
        self.events.append(FaultEvent(fault, started, self.progress.elapsed_s(), in_flight, error))

    @property
    def not_run(self) -> list[Fault]:
        """Faults whose trigger the load never reached (it ended first)."""
        return self.faults[len(self.events):]

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every fault has been played."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stop(self) -> None:
        """Skip the faults not yet due and wait for the one running (a restart) to end."""
        self._stop.set()
        self.progress.wake()
        self.wait()


def due(fault: Fault, prev: Fault | None, at_prev_end: dict[str, float]) -> float:
    """The progress (in `fault.unit`) at which `fault` runs. A relative trigger counts from the end
    of the previous fault; an absolute one keeps at least its scheduled gap to the previous fault
    of the same unit after that one ended, so that a slow restart does not eat a process's time up."""
    if fault.relative:
        return at_prev_end[fault.unit] + fault.at
    if prev is None or prev.relative or prev.unit != fault.unit:
        return fault.at
    return max(fault.at, at_prev_end[fault.unit] + fault.at - prev.at)
