"""Staging segments: KV block bytes between a worker and a kvstore of the same host, in shared memory.

Why: through gRPC a 368 KB SmolLM2 block costs about 0.45 ms of the sender's CPU and 0.3 ms of the
store's (serialization, HTTP/2 framing, loopback TCP, parsing; measured in batches of 32), against
some 0.04 ms for copying it. At 32 streams the stack moves about 2,000 blocks a run (prompts put by
prefill, fetched by decode, answers written back), and on two cores every millisecond the store or
a worker's event loop computes is taken from an engine step. So a client of the store on its host
moves the bytes through a file in /dev/shm that both map, and the messages carry offsets.

A client creates its segment (`StagingSegment`): a file named `pdserve-kv-<pid>-<random>`, mode
0600, whose first page holds a magic and a random token, and whose rest is the staging area. It
asks the store to map it (`AttachSegment`, with the token); a store that cannot (another host,
another /dev/shm, another user) says why, and the client sends block data inside messages as before.
The token proves that the caller can read the segment: a process elsewhere on the network cannot
make the store read or write a file it names.

A put writes each block into a region of the area and sends (offset, length); a get hands the store
one region, which it fills block after block (what does not fit goes inline). A region is reused
only after its call ended normally: after a cancelled or failed call the store may still be reading
or writing it, so it is retired, and the client starts a fresh segment once half the area is
retired. The bytes are checked where they always were: the store checks the wire header, readers
the checksum and the MAC.

The creator holds a shared `flock` on its file for as long as it lives; a new segment's creator
removes the segments whose lock it can take exclusively (their creator died without removing them).
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import re
import secrets
from collections import OrderedDict
from pathlib import Path

DEFAULT_DIR = Path("/dev/shm")
MAGIC = b"PDKVSHM1"
TOKEN_BYTES = 16
AREA_OFFSET = 4096  # the staging area starts on the second page; the first holds MAGIC and the token
NAME_PATTERN = re.compile(r"pdserve-kv-\d+-[0-9a-f]{32}")
MAX_ATTACHED = 64  # segments a store keeps mapped (least recently used unmapped first)


class SegmentError(Exception):
    """A segment the store cannot use: its message says why."""


class StagingSegment:
    """A client's segment: created, locked and mapped here. `close` removes the file; the pages live
    on while a call in flight or the store still maps them (the mapping goes with this object)."""

    def __init__(self, area_bytes: int, directory: Path = DEFAULT_DIR) -> None:
        if area_bytes <= 0:
            raise ValueError(f"a staging area needs a positive size, got {area_bytes}")
        remove_stale_segments(directory)
        self.name = f"pdserve-kv-{os.getpid()}-{secrets.token_hex(16)}"
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.path = directory / self.name
        # Made under a name the sweep of another worker starting now ignores, and renamed once locked.
        draft = directory / f".{self.name}.new"
        fd = os.open(draft, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while we live (see remove_stale_segments)
            # Reserved now: pages of a sparse file past a full tmpfs (a container's 64 MB /dev/shm)
            # would kill the process with SIGBUS when first written, where this fails with ENOSPC.
            os.posix_fallocate(fd, 0, AREA_OFFSET + area_bytes)
            self._map = mmap.mmap(fd, AREA_OFFSET + area_bytes)
            self._map[:len(MAGIC) + TOKEN_BYTES] = MAGIC + self.token
            os.rename(draft, self.path)
        except BaseException:
            os.close(fd)
            draft.unlink(missing_ok=True)
            raise
        self._fd = fd
        self.regions = RegionAllocator(area_bytes)

    def write(self, offset: int, data: bytes) -> None:
        self._map[AREA_OFFSET + offset:AREA_OFFSET + offset + len(data)] = data

    def read(self, offset: int, length: int) -> bytes:
        return self._map[AREA_OFFSET + offset:AREA_OFFSET + offset + length]

    def close(self) -> None:
        if self._fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


class RegionAllocator:
    """First-fit allocation of byte ranges of a staging area (a handful live at once)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, never adjacent
        self.retired_bytes = 0

    def reserve(self, length: int) -> int | None:
        """The offset of a free range of `length` bytes, now taken; None when none is that long."""
        for i, (offset, free) in enumerate(self._free):
            if free >= length:
                self._free[i:i + 1] = [(offset + length, free - length)] if free > length else []
                return offset
        return None

    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def free(self, offset: int, length: int) -> None:
        """Give back a range `reserve` returned; merged with its free neighbours."""
        i = next((k for k, (o, _) in enumerate(self._free) if o > offset), len(self._free))
        self._free.insert(i, (offset, length))
        if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:
            self._free[i:i + 2] = [(offset, length + self._free[i + 1][1])]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1:i + 1] = [(self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])]

    def retire(self, length: int) -> None:
        """A range that stays taken: the store may still use it (its call did not end normally)."""
        self.retired_bytes += length


def remove_stale_segments(directory: Path) -> int:
    """Remove the segments of this user whose creator is gone (their lock is free); how many."""
    removed = 0
    for path in directory.glob("pdserve-kv-*"):
        if not NAME_PATTERN.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
            removed += 1
        except OSError:  # locked: its creator lives
            pass
        finally:
            os.close(fd)
    return removed


class AttachedSegments:
    """The store's side: client segments mapped by name, their bounds checked on every access."""

    def __init__(self, directory: Path = DEFAULT_DIR) -> None:
        self.directory = directory
        self._maps: OrderedDict[str, tuple[bytes, mmap.mmap]] = OrderedDict()

    def attach(self, name: str, token: bytes) -> mmap.mmap:
        """The segment's mapping (mapped now unless it is already); SegmentError if it is unusable."""
        held = self._maps.get(name)
        if held is not None:
            if not hmac.compare_digest(held[0], token):
                raise SegmentError(f"segment {name!r}: wrong token")
            self._maps.move_to_end(name)
            return held[1]
        self._unmap_removed()
        segment = self._map_file(name, token)
        self._maps[name] = (token, segment)
        if len(self._maps) > MAX_ATTACHED:
            self._maps.popitem(last=False)[1][1].close()
        return segment

    def read(self, name: str, token: bytes, offset: int, length: int) -> bytes:
        segment = self.attach(name, token)
        start = self._checked(segment, name, offset, length)
        return segment[start:start + length]

    def write(self, name: str, token: bytes, offset: int, data: bytes) -> None:
        segment = self.attach(name, token)
        start = self._checked(segment, name, offset, len(data))
        segment[start:start + len(data)] = data

    def _unmap_removed(self) -> None:
        """Unmap the segments whose file is gone (their worker closed, or died and a later one removed
        it): a worker restarted again and again would otherwise leave its old pages held here."""
        for name in [n for n in self._maps if not (self.directory / n).exists()]:
            self._maps.pop(name)[1].close()

    def close(self) -> None:
        for _, segment in self._maps.values():
            segment.close()
        self._maps.clear()

    @staticmethod
    def _checked(segment: mmap.mmap, name: str, offset: int, length: int) -> int:
        if offset < 0 or length < 0 or AREA_OFFSET + offset + length > len(segment):
            raise SegmentError(f"segment {name!r}: range [{offset}, {offset + length}) is outside its "
                               f"{len(segment) - AREA_OFFSET}-byte area")
        return AREA_OFFSET + offset

    def _map_file(self, name: str, token: bytes) -> mmap.mmap:
        if not NAME_PATTERN.fullmatch(name):
            raise SegmentError(f"{name!r} is not a staging segment's name")
        try:
            fd = os.open(self.directory / name, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise SegmentError(f"segment {name!r} is not in {self.directory} here: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise SegmentError(f"segment {name!r} is not this user's alone")
            if info.st_size <= AREA_OFFSET:
                raise SegmentError(f"segment {name!r} has no staging area")
            segment = mmap.mmap(fd, info.st_size)
        finally:
            os.close(fd)
        if segment[:len(MAGIC)] != MAGIC or not hmac.compare_digest(
                segment[len(MAGIC):len(MAGIC) + TOKEN_BYTES], token):
            segment.close()
            raise SegmentError(f"segment {name!r}: wrong token")
        return segment
