"""A watched list file of worker targets (`file:///path`, gateway.targets).

One target a line (`host:port`, `[v6]:port` or `dns:///name:port`); blank lines and `#` comments
(whole-line or trailing) are ignored. `TargetFile.poll` is called on every health probe of the
pool (gateway.workers): it stats the file and re-reads it only when its signature (inode, mtime,
size) changed, so an unchanged file costs one stat a probe and no thread watches it.

Faults never empty a pool:
- a bad line is logged with the file and line number and skipped; the other lines are used;
- a file that is missing or unreadable keeps the last good membership (logged once per fault);
- a file that names no target at all is taken as a file being written (an editor that truncates
  before writing) and also keeps the last good membership.
Writers should replace the file atomically (write a temporary file, rename it over): `pdserve up`
does (pdserve.membership).
"""

from __future__ import annotations

import logging
import os

from gateway.targets import Target, parse_address_target

log = logging.getLogger(__name__)


def parse_lines(text: str) -> tuple[list[Target], list[tuple[int, str]]]:
    """The targets of a list file's text, in order without repeats, and (line number, why) of
    each bad line."""
    targets: list[Target] = []
    bad: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            target = parse_address_target(line)
        except ValueError as err:
            bad.append((number, str(err)))
            continue
        if target not in targets:
            targets.append(target)
    return targets, bad


class TargetFile:
    """The last good contents of one list file, re-read when the file changes."""

    def __init__(self, path: str, kind: str) -> None:
        self.path = path
        self.kind = kind  # "prefill" | "decode", for the logs
        self.targets: list[Target] = []  # the last good membership
        self.error = ""  # why the last poll could not use the file ("" when it could)
        self._signature: tuple[int, int, int] | None = None

    def poll(self) -> list[Target]:
        """The file's targets now (the last good ones when it cannot be used). Blocking I/O on the
        event loop on purpose: one stat of a local file a probe, a read of a few lines on a change."""
        try:
            st = os.stat(self.path)
            signature = (st.st_ino, st.st_mtime_ns, st.st_size)
            if signature == self._signature:
                return self.targets
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            self._signature = None  # read it again as soon as it is back
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            return self._keep(f"cannot read it ({reason})")
        self._signature = signature
        targets, bad = parse_lines(text)
        for number, why in bad:
            log.warning("%s list file %s line %d: %s; skipping that line", self.kind, self.path, number, why)
        if not targets:
            return self._keep("it names no target (being written?)")
        if targets != self.targets or self.error:
            log.info("%s list file %s: %d target%s: %s", self.kind, self.path, len(targets),
                     "s" * (len(targets) != 1), ", ".join(map(str, targets)))
        self.targets, self.error = targets, ""
        return targets

    def _keep(self, reason: str) -> list[Target]:
        error = f"list file {self.path}: {reason}"
        if error != self.error:  # log each fault once, not every probe
            log.warning("%s %s; keeping the last membership (%s)", self.kind, error,
                        ", ".join(map(str, self.targets)) or "no workers")
        self.error = error
        return self.targets
