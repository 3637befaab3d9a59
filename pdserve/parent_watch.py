"""A child of `pdserve up` (or of a test's stack) exits when its supervisor dies, even by SIGKILL,
so that no orphan keeps serving, or holding its port, with nobody to stop it.

`Supervisor.start` asks for it through the environment (`supervisor_env`); `arm()`, the first thing
`pdserve.cli.main` does, sets it up in the child. Two mechanisms:

- Linux: prctl(PR_SET_PDEATHSIG, SIGTERM). The kernel sends it when the *thread* that forked the
  child exits, not the process. So the supervisor asks for it only for children it starts from its
  main thread, which lives as long as it does: a child started from another thread (the soak's
  fault thread restarting a worker) would be killed as soon as that thread ended. The child then
  compares os.getppid() with the supervisor's pid, since a supervisor that died before prctl ran
  would never send the signal.
- Anywhere: a pipe. The supervisor holds its write end and never writes; the child's thread blocked
  reading the read end sees EOF once the supervisor's process is gone, however it died.

Either way the child gets SIGTERM, its ordinary graceful stop; the pipe's thread exits the process
hard after GRACE_S, since no supervisor is left to send SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping

PID_ENV = "PDSERVE_SUPERVISOR_PID"  # set: arm PR_SET_PDEATHSIG and check the parent is this pid
FD_ENV = "PDSERVE_SUPERVISOR_FD"  # the read end of the supervisor's pipe, inherited by the child
GRACE_S = 10.0  # after SIGTERM, as `pdserve up --grace-period` by default
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def supervisor_env(read_fd: int, pdeathsig: bool) -> dict[str, str]:
    """The environment that makes a child started now, by this process, watch it."""
    env = {FD_ENV: str(read_fd)}
    if pdeathsig:
        env[PID_ENV] = str(os.getpid())
    return env


def arm(environ: MutableMapping[str, str] = os.environ) -> None:
    """Watch the supervisor named in `environ`, if any. The variables are removed so that the
    child's own children (whose parent is someone else) do not act on them."""
    pid, fd = environ.pop(PID_ENV, None), environ.pop(FD_ENV, None)
    if pid is not None:
        _arm_pdeathsig(int(pid))
    if fd is not None:
        threading.Thread(target=_stop_on_eof, args=(int(fd),), daemon=True, name="supervisor-watch").start()


def _arm_pdeathsig(supervisor_pid: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # on failure the pipe still covers it
    if os.getppid() != supervisor_pid:  # it died before prctl: no signal will come
        raise SystemExit(f"pdserve: its supervisor (pid {supervisor_pid}) is gone already; exiting")


def _stop_on_eof(fd: int) -> None:
    try:
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while pipe.read(1):
                pass  # nothing is ever written; only EOF (no writer left) ends the loop
    except OSError:
        return  # not the pipe we were promised (fd not inherited): nothing to watch
    try:
        print("pdserve: its supervisor is gone; stopping", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr was a pipe to the supervisor, now broken: stopping matters, the message does not
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(1)
