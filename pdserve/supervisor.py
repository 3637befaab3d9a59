"""The supervisor of a local stack: children in their own process groups, their output forwarded
with a name prefix, health-checked until SERVING, restarted with back-off when a RestartPolicy is
given, stopped together (SIGTERM to each group, SIGKILL after a grace period), and never outliving
this process (pdserve/parent_watch.py). `pdserve up` runs it with a restart policy; pdserve.stack
(tests, `pdserve soak`) without one, so that they alone decide every kill and restart. A child can
also be retired (`retire`: a scale-in, pdserve.scaler): stopped, its exit expected, not restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve import parent_watch
from pdserve.tls import TlsConfig

POLL_S = 0.2
TAIL_LINES = 20


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One service to run: `command` serving gRPC health on `address`."""

    name: str  # "prefill-0", shown in logs and errors
    address: str  # host:port to health-check
    command: tuple[str, ...]  # the full command line
    env: tuple[tuple[str, str], ...] = ()  # extra environment of this child


def pdserve_command(*argv: str) -> tuple[str, ...]:
    """`pdserve <argv>` run by this interpreter (no reliance on PATH or the console script)."""
    return (sys.executable, "-m", "pdserve.cli", *argv)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How the supervisor of `pdserve up` brings back a child that died: after `first_delay_s`,
    doubling with each death up to `max_delay_s`; a child that had served `healthy_after_s` before
    dying starts again from `first_delay_s` (a crash loop backs off, a rare crash is back fast)."""

    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0
    # A child whose health check answers NOT_SERVING this long (a worker whose engine failed says so
    # for good: pdserve/runtime/async_engine.py) is killed and restarted like a dead one. Only an
    # explicit NOT_SERVING counts: a busy or unreachable child is not killed for being slow.
    not_serving_restart_s: float = 5.0
    health_every_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s or self.healthy_after_s < 0:
            raise ValueError(f"RestartPolicy needs 0 < first_delay_s <= max_delay_s and healthy_after_s >= 0, "
                             f"got {self.first_delay_s}, {self.max_delay_s}, {self.healthy_after_s}")

    def next_delay(self, previous_s: float | None, served_s: float) -> float:
        """The delay before the next restart, given the previous one (None: never restarted) and how
        long the child served before dying."""
        if previous_s is None or served_s >= self.healthy_after_s:
            return self.first_delay_s
        return min(previous_s * 2, self.max_delay_s)


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    forwarder: threading.Thread | None = None
    started_at: float = field(default_factory=time.monotonic)
    served_at: float | None = None  # when its health check first said SERVING
    restarts: int = 0  # how many times the supervisor had restarted this spec before this process
    backoff_s: float | None = None  # the delay this restart waited (None: not a restart)
    not_serving_since: float | None = None  # when its health check began to answer NOT_SERVING
    # Called by the output forwarder's thread with each line the child prints (pdserve.scaler
    # reads the gateway's membership changes there); must be quick and thread-safe.
    listeners: list[Callable[[str], None]] = field(default_factory=list)

    def last_output(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


class StartupError(RuntimeError):
    """A child did not come up; the message names it and shows its last output."""


class Supervisor:
    """Starts children in their own process groups, forwards their output, and stops them all.

    With a RestartPolicy (as `pdserve up` runs it) `watch` restarts a child that dies. Without one
    (pdserve.stack: tests and `pdserve soak` kill and restart children themselves through Stack)
    nothing is restarted behind the caller's back. Either way the children exit when this process
    dies (pdserve/parent_watch.py); for Linux's parent-death signal to stay armed, start children
    from the main thread, which lives as long as the supervisor."""

    def __init__(self, grace_s: float, restart: RestartPolicy | None = None) -> None:
        self.grace_s = grace_s
        self.restart = restart
        self.children: list[Child] = []
        self.restarting: list[tuple[float, float, Child]] = []  # (when, back-off delay, the dead child)
        self.retiring: dict[Child, float] = {}  # retired children not yet exited -> when to SIGKILL them
        self.stop_requested = False  # set by the signal handler; polled (no locks in handlers)
        self._death_pipe = os.pipe()  # never written: children watch its read end for EOF
        self._health_due = 0.0  # when watch() next asks the serving children for NOT_SERVING

    def start(self, spec: ChildSpec, restarts: int = 0, backoff_s: float | None = None) -> Child:
        read_fd = self._death_pipe[0]
        on_main_thread = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(
            spec.command, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1",
                 **parent_watch.supervisor_env(read_fd, pdeathsig=on_main_thread), **dict(spec.env)},
            pass_fds=(read_fd,),
            start_new_session=True)  # its own process group: killpg reaches anything it spawns
        child = Child(spec, proc, restarts=restarts, backoff_s=backoff_s)
        child.forwarder = threading.Thread(target=_forward_output, args=(child,), daemon=True,
                                           name=f"log-{spec.name}")
        child.forwarder.start()
        self.children.append(child)
        return child

    def dead_child(self) -> Child | None:
        """A child that has exited, with its output read to the end (for the error message)."""
        dead = next((c for c in self.children if c.proc.poll() is not None), None)
        if dead is not None and dead.forwarder is not None:
            dead.forwarder.join(timeout=2)
        return dead

    def wait_serving(self, children: Sequence[Child], timeout_s: float) -> bool:
        """True once every child is SERVING, False if a stop was requested; StartupError otherwise."""
        pending = list(children)
        deadline = time.monotonic() + timeout_s
        while pending:
            if self.stop_requested:
                return False
            dead = self.dead_child()
            if dead is not None:
                raise StartupError(f"{describe_exit(dead)} while starting up; its last output:\n"
                                   f"{dead.last_output()}")
            pending = [c for c in pending if not check_serving(c, timeout_s=1.0)]
            if pending and time.monotonic() > deadline:
                c = pending[0]
                raise StartupError(f"{c.spec.name} ({c.spec.address}) did not report SERVING within "
                                   f"{timeout_s:g} s; its last output:\n{c.last_output()}")
            if pending:
                time.sleep(POLL_S)
        return True

    def watch(self, tick: Callable[[], None] | None = None) -> Child | None:
        """Block until a stop is requested (None). A child that exits is returned, or, with a restart
        policy, restarted on its address after its back-off delay, and watching goes on. `tick` is
        called on each turn first (on this thread: children it starts keep their parent-death
        signal; pdserve.scaler)."""
        while not self.stop_requested:
            if tick is not None:
                tick()
            self._reap_retired()
            dead = self.dead_child()
            if dead is not None and self.restart is None:
                return dead
            if dead is not None:
                self._schedule_restart(dead, self.restart)
            self._start_due_restarts()
            self._note_serving_again()
            self._kill_not_serving()
            time.sleep(POLL_S)
        return None

    def retire(self, name: str) -> list[Child]:
        """Take the child named `name` out of supervision for good (a scale-in): a pending restart
        of it is dropped, a live process gets SIGTERM now and SIGKILL if it is still there after the
        grace period; its exit is expected and never restarted. The processes retired, live or dead."""
        live = [c for c in self.children if c.spec.name == name]
        for child in live:
            self.children.remove(child)
            _signal_group(child, signal.SIGTERM)
            self.retiring[child] = time.monotonic() + self.grace_s
        dropped = [entry for entry in self.restarting if entry[2].spec.name == name]
        for entry in dropped:
            self.restarting.remove(entry)
        return [*live, *(entry[2] for entry in dropped)]

    def _reap_retired(self) -> None:
        """Log the retired children that exited; SIGKILL those past their grace period."""
        now = time.monotonic()
        for child, kill_at in list(self.retiring.items()):
            if child.proc.poll() is not None:
                del self.retiring[child]
                code = child.proc.returncode
                announce(f"{child.spec.name} ({child.spec.address}) stopped as asked "
                         f"({'signal ' + str(-code) if code < 0 else 'exit code ' + str(code)})")
            elif now >= kill_at:
                announce(f"{child.spec.name} ignored SIGTERM for {self.grace_s:g} s; killing it")
                _signal_group(child, signal.SIGKILL)
                self.retiring[child] = float("inf")  # killed: only its exit is left to see

    def _kill_not_serving(self) -> None:
        """SIGKILL a served child that has answered NOT_SERVING for the policy's time; the next
        watch() turn finds it dead and restarts it."""
        now = time.monotonic()
        if self.restart is None or now < self._health_due:
            return
        self._health_due = now + self.restart.health_every_s
        for child in [c for c in self.children if c.served_at is not None and c.proc.poll() is None]:
            if _health_status(child) != "NOT_SERVING":
                child.not_serving_since = None
                continue
            child.not_serving_since = child.not_serving_since or now
            if now - child.not_serving_since >= self.restart.not_serving_restart_s:
                announce(f"{child.spec.name} ({child.spec.address}) has answered NOT_SERVING for "
                         f"{now - child.not_serving_since:.0f} s; killing it to restart it")
                _signal_group(child, signal.SIGKILL)

    def _schedule_restart(self, dead: Child, policy: RestartPolicy) -> None:
        now = time.monotonic()
        served_s = now - dead.served_at if dead.served_at is not None else 0.0
        delay = policy.next_delay(dead.backoff_s, served_s)
        self.children.remove(dead)
        self.restarting.append((now + delay, delay, dead))
        when = (f"after serving {served_s:.0f} s" if dead.served_at is not None
                else f"{now - dead.started_at:.1f} s after it started, before it reported SERVING")
        announce(f"{describe_exit(dead)} {when}; restarting it in {delay:g} s (restart {dead.restarts + 1})")

    def _start_due_restarts(self) -> None:
        now = time.monotonic()
        for entry in [e for e in self.restarting if e[0] <= now]:
            self.restarting.remove(entry)
            _, delay, dead = entry
            new = self.start(dead.spec, restarts=dead.restarts + 1, backoff_s=delay)
            announce(f"restarted {dead.spec.name} ({dead.spec.address}) as pid {new.proc.pid}")

    def _note_serving_again(self) -> None:
        """Log a restarted child's return once its health check says SERVING (this also starts the
        time after which its next death backs off from the first delay again)."""
        for child in self.children:
            if child.restarts and child.served_at is None and child.proc.poll() is None \
                    and check_serving(child, timeout_s=0.5):
                announce(f"{child.spec.name} ({child.spec.address}) is serving again after restart {child.restarts}")

    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL the ones still there after the grace period."""
        self.restarting.clear()
        children = [*self.children, *self.retiring]
        for child in children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.spec.name} ignored SIGTERM for {self.grace_s:g} s; killing it",
                      file=sys.stderr)
                _signal_group(child, signal.SIGKILL)
                child.proc.wait()
        self.retiring.clear()


def announce(message: str) -> None:
    print(f"pdserve up: {message}", file=sys.stderr, flush=True)


def check_serving(child: Child, timeout_s: float) -> bool:
    """Whether the child's health check says SERVING; stamps `served_at` the first time it does."""
    from pdserve.healthcheck import is_serving

    if not is_serving(child.spec.address, timeout_s=timeout_s, config=_tls_of(child)):
        return False
    if child.served_at is None:
        child.served_at = time.monotonic()
    return True


def _health_status(child: Child) -> str:
    """The child's health status name ("SERVING", "NOT_SERVING", "UNREACHABLE: ...")."""
    from pdserve.healthcheck import check

    return check(child.spec.address, timeout_s=1.0, config=_tls_of(child))


def _tls_of(child: Child) -> TlsConfig:
    """The TLS the child serves (PDSERVE_TLS_* of its environment), to health-check it with."""
    return TlsConfig.from_env({**os.environ, **dict(child.spec.env)})


def _signal_group(child: Child, sig: int) -> None:
    if child.proc.poll() is not None:
        return  # reaped already: its pid (the group id) may belong to someone else by now
    try:
        os.killpg(child.proc.pid, sig)
    except ProcessLookupError:
        pass


def _forward_output(child: Child) -> None:
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        line = line.rstrip("\n")
        child.tail.append(line)
        print(f"[{child.spec.name}] {line}", file=sys.stderr, flush=True)
        for listener in child.listeners:
            listener(line)


def describe_exit(child: Child) -> str:
    """E.g. "decode-0 (127.0.0.1:4000) was killed by signal 9"."""
    code = child.proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{child.spec.name} ({child.spec.address}) {how}"
