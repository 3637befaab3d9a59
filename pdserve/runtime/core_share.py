"""The cores of one host shared by its prefill and decode workers (`pdserve up`).

Why: each worker's engine thread runs torch with its share of the cores (two workers on two cores:
one each), because two OpenMP teams on the same cores slow each other many times over (a member
preempted by the other process holds every barrier of its team). But a prefill worker idles most of
a long decode (at 32 streams of 200-token prompts and 128-token answers, 9 of 40 s; the decode
worker computed 35), so a decode worker that keeps to its share leaves a core unused.

So the workers of a host map one small file: each prefill worker writes there until when it is
computing (refreshed before each of its steps, cleared when it idles; a worker that died is
forgotten HOLD_S later). A decode worker steps on its `wide` thread count while no prefill worker
is computing, and on its `narrow` share otherwise, checked before each step and between the layers
of a step (`between_layers`), so that a prompt arriving mid-step waits at most about a layer for
its core (a one-call C step, a few milliseconds long, keeps the count it started with). Each time is
one aligned 8-byte store: a reader sees the old time or the new one.

Workers that `pdserve scale` adds copy their kind's first command, so added prefill workers share
slot 0: one's release may widen the decode worker while another computes, until its next step.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

MAX_SLOTS = 64  # prefill workers a file has room for
HOLD_S = 0.5  # a prefill worker's claim lasts this long unless refreshed (its steps are shorter)
_SLOT = struct.Struct("d")  # CLOCK_MONOTONIC seconds (one clock for every process of the host)


class CoreShare:
    """The host's file of prefill workers' busy-until times, mapped."""

    def __init__(self, path: str | Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < MAX_SLOTS * _SLOT.size:
                os.ftruncate(fd, MAX_SLOTS * _SLOT.size)
            self._map = mmap.mmap(fd, MAX_SLOTS * _SLOT.size)
        finally:
            os.close(fd)

    def hold(self, slot: int) -> None:
        """Prefill worker `slot` computes (for HOLD_S unless held again)."""
        _SLOT.pack_into(self._map, slot * _SLOT.size, time.monotonic() + HOLD_S)

    def release(self, slot: int) -> None:
        """Prefill worker `slot` idles."""
        _SLOT.pack_into(self._map, slot * _SLOT.size, 0.0)

    def prefill_busy(self) -> bool:
        """Whether some prefill worker of the host is computing. A time further ahead than HOLD_S
        is not one a live worker wrote (a file left from before a reboot): ignored."""
        now = time.monotonic()
        return any(now < until <= now + HOLD_S for (until,) in _SLOT.iter_unpack(self._map))


class PrefillCores:
    """A prefill engine's side: held while it steps, released when it idles."""

    def __init__(self, share: CoreShare, slot: int) -> None:
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"core share slot must be in [0, {MAX_SLOTS}), got {slot}")
        self.share, self.slot = share, slot

    def before_step(self) -> None:
        self.share.hold(self.slot)

    def idle(self) -> None:
        self.share.release(self.slot)


class DecodeCores:
    """A decode engine's side: the threads of its steps, `wide` while no prefill worker computes, else
    `narrow`. `budget` is the step's count, set before each step: the engine thread's OpenMP team
    (torch's ops, and the C kernels, which split their work on that team: kernels/cpu/threads.h)
    takes it, and a one-call C decode step takes it for its region (cpu_decode_step.StepThreads).
    A prefill claim narrows it between layers. `set_threads(n)` sets the calling (engine) thread's
    OpenMP count. (Before the C step ran on the team, its own threads met a wide team's idle
    members spinning after each region, and steps started narrow: one stream, 6.6 ms a token
    through the stack against 6.2 now.)"""

    def __init__(self, share: CoreShare, wide: int, narrow: int, set_threads: Callable[[int], None]) -> None:
        if not 1 <= narrow <= wide:
            raise ValueError(f"decode threads need 1 <= narrow ({narrow}) <= wide ({wide})")
        self.share, self.wide, self.narrow = share, wide, narrow
        self._set_threads = set_threads
        self.budget = narrow
        self.threads = narrow  # what the engine thread has claimed (the worker claims `narrow` first)
        self.switches = 0

    def before_step(self) -> None:
        self.budget = self.narrow if self.share.prefill_busy() else self.wide
        self._use(self.budget)

    def between_layers(self) -> None:
        if self.budget != self.narrow and self.share.prefill_busy():
            self.budget = self.narrow
        self._use(self.budget)

    def idle(self) -> None:
        pass

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
            self.switches += 1
