"""A plain progress bar on stderr (no dependency): `[#####.....] 12/20 label`, redrawn in place."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, title: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.title, self.width = total, title, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()

    def __call__(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r{self.title} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label}"
        self.stream.write(line.ljust(90))
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
