"""The control socket of a running `pdserve up`, which `pdserve scale` talks to.

A Unix socket, `control.sock` in the stack's run directory (`run_dir`: $XDG_RUNTIME_DIR/pdserve/
up-PORT, else /tmp/pdserve-UID/up-PORT, PORT being up's --grpc-port; or --run-dir). Who may reach
it: a loopback TCP port would be open to every local user (ports have no owner), so it is a Unix
socket, in a directory that must be the caller's own with mode 0700 (checked, not assumed: another
user may have created /tmp/pdserve-UID first), the socket itself 0600, and each connection's peer
credentials (SO_PEERCRED) must be this user's (or root's). Nothing secret travels on it, but it can
start and stop processes.

One request a connection, one JSON object a line each way: {"scale": {"decode": 3}} or {} (just
the membership); the answer {"ok": true, "prefill": [...], "decode": [...]} or {"ok": false,
"error": "one line", "usage": bool}. Requests are carried out one at a time by the thread that
owns the supervisor (pdserve.scaler): the socket's thread only queues them and waits.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import stat
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOCKET_NAME = "control.sock"
MAX_REQUEST_BYTES = 4096


class ControlError(RuntimeError):
    """The run directory or socket cannot be used; the message is one line for a person."""


def run_dir(grpc_port: int, environ: dict[str, str] | None = None) -> Path:
    """The default run directory of the `up` whose gateway listens on `grpc_port`."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR", "")
    base = Path(runtime) / "pdserve" if runtime else Path("/tmp") / f"pdserve-{os.getuid()}"
    return base / f"up-{grpc_port}"


def make_private_dir(path: Path) -> None:
    """Create `path` (and its missing parents) with mode 0700; ControlError unless it is then a real
    directory of this user that no one else can enter."""
    ours = [path.parent, path] if path.parent.name.startswith("pdserve") else [path]  # run_dir's levels
    ours[0].parent.mkdir(parents=True, exist_ok=True)
    for part in ours:
        part.mkdir(mode=0o700, exist_ok=True)  # (parents=True would ignore the mode)
        _check_private(part)


def _check_private(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlError(f"{path} is not a directory (a symlink?); remove it or pass --run-dir")
    if st.st_uid != os.getuid():
        raise ControlError(f"{path} belongs to uid {st.st_uid}, not to you; remove it or pass --run-dir")
    if st.st_mode & 0o077:
        raise ControlError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           "chmod 700 it or pass --run-dir")


@dataclass(eq=False)
class Request:
    """One request from `pdserve scale`, answered once by the supervisor's thread."""

    body: dict[str, Any]
    _answer: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1), repr=False)

    def reply(self, answer: dict[str, Any]) -> None:
        self._answer.put_nowait(answer)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        try:
            return self._answer.get(timeout=timeout_s)
        except queue.Empty:
            return {"ok": False, "error": f"pdserve up did not answer within {timeout_s:g} s"}


class ControlServer:
    """The listening socket and its thread; requests land on `requests` for the supervisor's thread."""

    def __init__(self, directory: Path, answer_timeout_s: float) -> None:
        self.path = directory / SOCKET_NAME
        self.answer_timeout_s = answer_timeout_s
        self.requests: queue.Queue[Request] = queue.Queue()
        try:
            make_private_dir(directory)
            self._take_over_stale_socket()
            self._sock = self._listen()
        except OSError as err:
            raise ControlError(f"cannot make the control socket {self.path}: {err.strerror or err}; "
                               "pass --run-dir") from None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="control-socket")
        self._thread.start()

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket file is created 0600, no window where it is wider
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        sock.listen(8)
        return sock

    def _take_over_stale_socket(self) -> None:
        if not self.path.exists():
            return
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # left by an `up` that was killed
                return
        raise ControlError(f"another pdserve up answers on {self.path}; stop it or pass --run-dir")

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except (OSError, ValueError):
                    continue  # a client that went away or sent junk: nothing to answer

    def _answer(self, conn: socket.socket) -> None:
        if not _peer_allowed(conn):
            conn.sendall(_line({"ok": False, "error": "refused: not the user running pdserve up"}))
            return
        conn.settimeout(5)
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REQUEST_BYTES:
            chunk = conn.recv(MAX_REQUEST_BYTES)
            if not chunk:
                break
            data += chunk
        body = json.loads(data or b"{}")
        if not isinstance(body, dict):
            raise ValueError("a request is a JSON object")
        request = Request(body)
        self.requests.put(request)
        conn.settimeout(None)
        conn.sendall(_line(request.wait(self.answer_timeout_s)))

    def close(self) -> None:
        """Stop listening, remove the socket, and refuse what is still queued."""
        self._sock.close()
        self.path.unlink(missing_ok=True)
        while True:
            try:
                self.requests.get_nowait().reply({"ok": False, "error": "pdserve up is stopping"})
            except queue.Empty:
                return


def _peer_allowed(conn: socket.socket) -> bool:
    """The connecting process runs as this user (or root): SO_PEERCRED's (pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)


def _line(message: dict[str, Any]) -> bytes:
    return (json.dumps(message) + "\n").encode()


def call(directory: Path, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Send one request to the `up` of `directory` and return its answer; ControlError (one line)
    when no `up` listens there."""
    path = directory / SOCKET_NAME
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except OSError as err:  # none there, a stale one, a path too long...
            raise ControlError(f"no pdserve up runs here (no control socket answers at {path}: "
                               f"{err.strerror or err}; pass --grpc-port or --run-dir as given to up)") from None
        sock.sendall(_line(body))
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            raise ControlError(f"pdserve up did not answer within {timeout_s:g} s") from None
    if not data:
        raise ControlError(f"pdserve up at {path} closed the connection without an answer")
    return json.loads(data)
