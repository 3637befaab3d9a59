"""The cores of one host shared by its prefill and decode workers (`pdserve up`).

Why: each worker's engine thread runs torch with its share of the cores (two workers on two cores:
one each), because two OpenMP teams on the same cores slow each other many times over (a member
preempted by the other process holds every barrier of its team). But each kind of worker idles
while the other computes: a prefill worker most of a long decode (at 32 streams of 200-token prompts
and 128-token answers, 9 of 40 s; the decode worker computed 35), a decode worker between one
stream's requests, while the next prompt is computed. A worker that keeps to its share then leaves a
core unused: with one stream a 200-token prompt took 472 ms on one core against 320 on two.

So the workers of a host map one small file: each worker writes to its slot there until when it is
computing (refreshed before each of its steps and between their layers, cleared when it idles; a
worker that died is forgotten HOLD_S later), prefill workers in the first half, decode workers in
the second. A worker steps on its `wide` thread count while no worker of the other kind is
computing, and on its `narrow` share otherwise, checked before each step and between the layers of
a step (`between_layers`), so that the other kind's work arriving mid-step waits at most about a
layer for its core (a one-call C decode step, a few milliseconds long, keeps the count it started with). Each
time is one aligned 8-byte store: a reader sees the old time or the new one.

A decode worker may also yield (`--decode-yield-ms`, `WorkerCores.yields`): while a prefill worker
computes and its own batch has room, it skips stepping, its claim released, so the prefill worker
computes wide (it widens between layers too), until the set time after its last step began.

Workers that `pdserve scale` adds copy their kind's first command, so added workers share their
kind's slot 0: one's release may widen the other kind while another computes, until its next step.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

MAX_SLOTS = 64  # workers of each kind a file has room for
HOLD_S = 0.5  # a worker's claim lasts this long unless refreshed (its steps are shorter)
KINDS = ("prefill", "decode")  # the file's two halves, in order
_SLOT = struct.Struct("d")  # CLOCK_MONOTONIC seconds (one clock for every process of the host)


class CoreShare:
    """The host's file of workers' busy-until times, mapped."""

    def __init__(self, path: str | Path) -> None:
        size = len(KINDS) * MAX_SLOTS * _SLOT.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def hold(self, kind: str, slot: int) -> None:
        """The `kind` worker of `slot` computes (for HOLD_S unless held again)."""
        _SLOT.pack_into(self._map, self._offset(kind, slot), time.monotonic() + HOLD_S)

    def release(self, kind: str, slot: int) -> None:
        """The `kind` worker of `slot` idles."""
        _SLOT.pack_into(self._map, self._offset(kind, slot), 0.0)

    def busy(self, kind: str) -> bool:
        """Whether some `kind` worker of the host is computing. A time further ahead than HOLD_S is
        not one a live worker wrote (a file left from before a reboot): ignored."""
        now = time.monotonic()
        start = self._offset(kind, 0)
        half = self._map[start:start + MAX_SLOTS * _SLOT.size]  # a copy of 512 bytes
        return any(now < until <= now + HOLD_S for (until,) in _SLOT.iter_unpack(half))

    @staticmethod
    def _offset(kind: str, slot: int) -> int:
        if kind not in KINDS:
            raise ValueError(f"core share kinds are {KINDS}, got {kind!r}")
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"core share slot must be in [0, {MAX_SLOTS}), got {slot}")
        return (KINDS.index(kind) * MAX_SLOTS + slot) * _SLOT.size


class WorkerCores:
    """One worker's side: its claim held while it steps and released when it idles, and the threads
    of its steps, `wide` while no worker of the other kind computes, else `narrow`. `budget` is the
    step's count, set before each step: the engine thread's OpenMP team (torch's ops, and the C
    kernels, which split their work on that team: kernels/cpu/threads.h) takes it, and a decode
    worker's one-call C step takes it for its region (cpu_decode_step.StepThreads). The other kind's
    claim narrows it between layers. `set_threads(n)` sets the calling (engine) thread's OpenMP
    count. (Before the C step ran on the team, its own threads met a wide team's idle members
    spinning after each region, and steps started narrow: one stream, 6.6 ms a token through the
    stack against 6.2 now.)"""

    def __init__(self, share: CoreShare, kind: str, slot: int, wide: int, narrow: int,
                 set_threads: Callable[[int], None], yield_s: float = 0.0) -> None:
        if not 1 <= narrow <= wide:
            raise ValueError(f"{kind} threads need 1 <= narrow ({narrow}) <= wide ({wide})")
        if not yield_s >= 0:
            raise ValueError(f"{kind} yield must be >= 0 seconds, got {yield_s}")
        share.release(kind, slot)  # no claim left from an earlier worker of this slot (kind, slot checked)
        self.share, self.kind, self.slot, self.wide, self.narrow = share, kind, slot, wide, narrow
        self.other = KINDS[1 - KINDS.index(kind)]
        self.yield_s = yield_s
        self._set_threads = set_threads
        self.budget = narrow
        self.threads = narrow  # what the engine thread has claimed (the worker claims `narrow` first)
        self.switches = 0
        self._stepped_at = float("-inf")  # when the last step began (monotonic)

    def before_step(self) -> None:
        self._stepped_at = time.monotonic()
        self.share.hold(self.kind, self.slot)
        self.budget = self.narrow if self.share.busy(self.other) else self.wide
        self._use(self.budget)

    def between_layers(self) -> None:
        # Held again here too: a prefill step of 512 tokens on one thread outlasts HOLD_S (~1.7 s for
        # SmolLM2 fp32), and a claim lapsed mid-step told the decode worker that no prefill worker
        # computed: its two threads then met the prefill's on two cores, and 330 of a 32-stream run's
        # 500 one-call steps ran in its one-thread fallback for such loaded steps. Both ways: a step
        # narrows when the other kind starts and widens when it yields or idles.
        self.share.hold(self.kind, self.slot)
        self.budget = self.narrow if self.share.busy(self.other) else self.wide
        self._use(self.budget)

    def yields(self, batch: int, capacity: int) -> bool:
        """Whether this worker should leave the cores to the other kind now instead of stepping: the
        other kind computes, this worker's batch has room for what it computes (batch < capacity),
        and this worker's last step began less than `yield_s` ago. The caller releases its claim
        (`idle`) while it yields, so the other kind computes wide."""
        return (self.yield_s > 0 and batch < capacity and time.monotonic() - self._stepped_at < self.yield_s
                and self.share.busy(self.other))

    def idle(self) -> None:
        self.share.release(self.kind, self.slot)

    def _use(self, threads: int) -> None:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
            self.switches += 1
