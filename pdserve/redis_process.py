"""A redis-server child process on a free loopback port: the soak's Redis tier and the tests' fixture.

It runs without persistence (`--save "" --appendonly no`), so a restart comes back empty, as after
a crash; `kill()` is SIGKILL, as a crash or an OOM kill would be.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from pdserve.ports import free_port


class RedisProcess:
    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        self.port = port or free_port()
        self.binary = binary or shutil.which("redis-server")  # None: found at start, or a clear error
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *extra: str, timeout_s: float = 10.0) -> RedisProcess:
        """Start it (`extra`: more redis-server flags) and wait until it answers PING."""
        if self.binary is None:
            raise FileNotFoundError("redis-server is not on PATH: install it (make test does) or run without Redis")
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._pong():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.running:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
