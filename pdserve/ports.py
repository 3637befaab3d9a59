"""Local TCP ports: a free one to bind, whether one is taken, and by which process (/proc)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Collection, Sequence
from pathlib import Path


# Every port free_port has handed out in this process: such a port is planned for a server that
# has not bound it yet, and the kernel may offer it again once released. gRPC servers bind with
# SO_REUSEPORT, so two of ours given one port would both start and split its connections silently.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_OFFERS_BEFORE_GIVING_UP = 10_000  # the kernel's offers are random: a bound, never a spin


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free now on `host`, never one this process handed out before, nor one of `avoid`
    (fixed ports the caller plans to bind, e.g. the gateway's --grpc-port)."""
    with _handed_out_lock:
        for _ in range(_OFFERS_BEFORE_GIVING_UP):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out and port not in avoid:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already "
                  f"({len(_handed_out)} handed out): the ephemeral range is nearly used up")


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound, or None when it is free (checked before starting anything)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError as err:
            return err.strerror or str(err)
    return None


def port_holder(port: int) -> str | None:
    """E.g. "pid 4242 (python3)": the process listening on `port`, where /proc shows it (Linux; a
    process of another user shows its socket but not its fds, and then this says nothing)."""
    sockets = _listening_sockets(port)
    for fd_dir in Path("/proc").glob("[0-9]*/fd") if sockets else ():
        try:
            if any(os.readlink(fd) in sockets for fd in fd_dir.iterdir()):
                return f"pid {fd_dir.parent.name} ({(fd_dir.parent / 'comm').read_text().strip()})"
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return None


def _listening_sockets(port: int) -> set[str]:
    """The fd link targets ("socket:[inode]") of the TCP sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for cols in (row.split() for row in rows):
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                found.add(f"socket:[{cols[9]}]")
    return found


def taken_port(needed: Sequence[tuple[str, str, int]]) -> str | None:
    """One line naming the first port of `needed` that is taken and who holds it; None if all are free."""
    for what, host, port in needed:
        busy = port_in_use(host, port)
        if busy:
            holder = port_holder(port)
            return f"cannot use {what} on {host}: {busy}" + (f", held by {holder}" if holder else "")
    return None
