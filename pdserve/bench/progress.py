"""A one-line progress bar on stderr (redrawn in place on a terminal, a final line otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, label: str, stream: TextIO | None = None, enabled: bool = True,
                 min_interval_s: float = 0.1) -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.live = enabled and self.stream.isatty()
        self.enabled = enabled
        self.done = self.failed = 0
        self._start = time.perf_counter()
        self._drawn_at = 0.0
        self._min_interval_s = min_interval_s

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.live and (now - self._drawn_at >= self._min_interval_s or self.done == self.total):
            self._drawn_at = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def line(self, width: int = 30) -> str:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * width)
        elapsed = time.perf_counter() - self._start
        failed = f" {self.failed} failed" if self.failed else ""
        return (f"{self.label} [{bar:<{width}}] {self.done}/{self.total} "
                f"{elapsed:5.1f}s {self.done / elapsed if elapsed else 0:5.1f} req/s{failed}")

    def close(self) -> None:
        if not self.enabled:
            return
        self.stream.write(("\r" if self.live else "") + self.line() + "\n")
        self.stream.flush()
