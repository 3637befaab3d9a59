"""A redis-server child for the soak's Redis tier: started on a free loopback port without
persistence (a restart comes back empty, as after a crash), SIGKILLed and restarted by the faults."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from pdserve.commands.up import free_port


class RedisProcess:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not on PATH; install it or run without --redis")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._pong():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING on port {self.port} in {timeout_s:g} s")
            time.sleep(0.05)
        return self

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
