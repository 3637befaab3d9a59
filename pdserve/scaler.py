"""Growing and shrinking the workers of a running `pdserve up` (`pdserve scale`, SIGUSR1/SIGUSR2).

Requests come from the control socket (pdserve.control) or from signals (SIGUSR1: one decode
worker more, SIGUSR2: one fewer) and are carried out one at a time by `tick`, which the
supervisor's watch loop calls on the main thread (children started there keep their parent-death
signal). Nothing in it blocks for long: each tick moves the request in progress a step on.

- Growing starts a worker as `up` started the others (pdserve.membership.worker_like: same command
  and environment, a free port), supervised (restarted if it dies later), waits for it to report
  SERVING, then adds it to the gateway's list file; the request is answered once the gateway says
  the worker is healthy (its log line, from the forwarded output) or after GATEWAY_ACK_S.
- Shrinking removes the newest worker of the kind from the list file first; once the gateway says
  it left its pool (or after GATEWAY_ACK_S) the worker is retired (Supervisor.retire: SIGTERM, its
  exit expected, not restarted). The gateway sends it nothing new; the streams it runs are left to
  finish within the worker's own shutdown. The request is answered once the process is gone.
"""

from __future__ import annotations

import queue
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.control import ControlServer, Request
from pdserve.membership import KINDS, METRICS_ENV, list_file, worker_like, write_list_file
from pdserve.supervisor import Child, ChildSpec, Supervisor, announce, check_serving, describe_exit

DEFAULT_MAX_WORKERS = 16
GATEWAY_ACK_S = 5.0  # at most this long for the gateway's log to confirm a membership change
_GATEWAY_SAYS = re.compile(r"\b(prefill|decode) worker (\S+) (left the pool|is healthy)")


class ScaleRefused(ValueError):
    """A request that cannot be carried out; one line. `usage`: the numbers asked for are invalid."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(eq=False)
class _Op:
    """One scale request in progress."""

    request: Request | None  # None: from a signal
    deadline: float  # for the new workers to report SERVING
    starting: list[tuple[str, Child]] = field(default_factory=list)  # (kind, child) not yet SERVING
    joining: dict[str, float] = field(default_factory=dict)  # address -> until when to wait for the gateway
    leaving: list[tuple[ChildSpec, float]] = field(default_factory=list)  # out of the file, not yet stopped
    stopping: list[Child] = field(default_factory=list)  # retired, not yet exited
    failures: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not (self.starting or self.joining or self.leaving or self.stopping)


class Scaler:
    """The membership of `up`'s gateway (its list files) and the scale requests that change it."""

    def __init__(self, sup: Supervisor, workers: list[ChildSpec], run_dir: Path, control: ControlServer,
                 startup_timeout_s: float, max_workers: int = DEFAULT_MAX_WORKERS, refusal: str = "") -> None:
        self.sup = sup
        self.run_dir = run_dir
        self.control = control
        self.startup_timeout_s = startup_timeout_s
        self.max_workers = max_workers
        self.refusal = refusal  # why this `up` cannot scale ("" when it can)
        self.members = {kind: [w for w in workers if w.name.startswith(f"{kind}-")] for kind in KINDS}
        self.templates = {kind: specs[0] for kind, specs in self.members.items() if specs}
        self.next_index = {kind: len(specs) for kind, specs in self.members.items()}
        self.pending_signals = 0  # decode workers to add (negative: remove), from SIGUSR1/SIGUSR2
        self._op: _Op | None = None
        self._gateway_said: set[tuple[str, str]] = set()  # (address, "left the pool" | "is healthy")

    def write_lists(self) -> None:
        for kind in KINDS:
            write_list_file(list_file(self.run_dir, kind), [spec.address for spec in self.members[kind]])

    def membership(self) -> dict[str, list[str]]:
        return {kind: [spec.address for spec in specs] for kind, specs in self.members.items()}

    def on_signal(self, delta: int) -> None:
        """From a signal handler: one decode worker more (+1) or fewer (-1), at the next tick."""
        self.pending_signals += delta

    def tick(self) -> None:
        """Move the request in progress on, or begin the next one."""
        self._listen_to_gateway()
        if self._op is None:
            self._op = self._next_op()
        if self._op is not None:
            self._advance(self._op)
            if self._op.done:
                self._finish(self._op)
                self._op = None

    def close(self) -> None:
        """`up` is stopping: answer what is left, stop listening, remove the files."""
        if self._op is not None and self._op.request is not None:
            self._op.request.reply({"ok": False, "error": "pdserve up is stopping", **self.membership()})
        self.control.close()
        for kind in KINDS:
            list_file(self.run_dir, kind).unlink(missing_ok=True)
        try:
            self.run_dir.rmdir()
        except OSError:
            pass  # not empty: someone else's files, left alone

    # ---- requests

    def _next_op(self) -> _Op | None:
        if self.pending_signals:
            delta, self.pending_signals = self.pending_signals, 0
            try:
                return self._begin({"decode": len(self.members["decode"]) + delta}, None)
            except ScaleRefused as err:
                announce(f"{'SIGUSR1' if delta > 0 else 'SIGUSR2'}: not scaling: {err}")
                return None
        try:
            request = self.control.requests.get_nowait()
        except queue.Empty:
            return None
        try:
            return self._begin(self._wanted(request.body), request)
        except ScaleRefused as err:
            request.reply({"ok": False, "error": str(err), "usage": err.usage, **self.membership()})
            return None

    def _wanted(self, body: dict[str, Any]) -> dict[str, int]:
        wanted = body.get("scale") or {}
        if self.refusal and wanted:
            raise ScaleRefused(self.refusal)
        if not isinstance(wanted, dict) or not set(wanted) <= set(KINDS):
            raise ScaleRefused(f"a scale request names {', '.join(KINDS)} worker counts", usage=True)
        for kind, count in wanted.items():
            if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= self.max_workers:
                raise ScaleRefused(f"--{kind} {count}: must be 1 to {self.max_workers} (up's --max-workers)",
                                   usage=True)
        return wanted

    def _begin(self, wanted: dict[str, int], request: Request | None) -> _Op:
        for kind, count in wanted.items():
            if not 1 <= count <= self.max_workers:
                raise ScaleRefused(f"{kind} workers must stay within 1 to {self.max_workers}, not {count}")
        now = time.monotonic()
        op = _Op(request, deadline=now + self.startup_timeout_s)
        for kind, count in wanted.items():
            have = self.members[kind]
            for _ in range(count - len(have)):
                op.starting.append((kind, self._grow(kind)))
            if count < len(have):
                self.members[kind], leaving = have[:count], have[count:]
                op.leaving += [(spec, now + GATEWAY_ACK_S) for spec in leaving]
                names = ", ".join(spec.name for spec in leaving)
                announce(f"scaling {kind} to {count}: taking {names} out of the gateway's list")
        if op.leaving:
            self.write_lists()  # first out of the gateway's list, stopped only once it is out of its pool
        return op

    def _grow(self, kind: str) -> Child:
        name = f"{kind}-{self.next_index[kind]}"
        self.next_index[kind] += 1
        spec = worker_like(self.templates[kind], name)
        child = self.sup.start(spec)
        metrics = dict(spec.env).get(METRICS_ENV)
        announce(f"scaling {kind} up: started {name} ({spec.address}) as pid {child.proc.pid}"
                 + (f", /metrics on port {metrics}" if metrics else ""))
        return child

    # ---- progress

    def _advance(self, op: _Op) -> None:
        now = time.monotonic()
        for kind, child in list(op.starting):
            self._advance_starting(op, kind, child, now)
        for address, until in list(op.joining.items()):
            if self._said(address, "is healthy") or now >= until:
                del op.joining[address]
        for spec, release_at in list(op.leaving):
            if self._said(spec.address, "left the pool") or now >= release_at:
                op.leaving.remove((spec, release_at))
                announce(f"{spec.name} ({spec.address}) is out of the gateway's pool; stopping it")
                op.stopping += self.sup.retire(spec.name)
        op.stopping = [c for c in op.stopping if c in self.sup.retiring]

    def _advance_starting(self, op: _Op, kind: str, child: Child, now: float) -> None:
        name = child.spec.name
        if child.proc.poll() is not None or child not in self.sup.children:
            failure = f"{describe_exit(child)} before it reported SERVING (its output is in up's log)"
        elif check_serving(child, timeout_s=0.5):
            op.starting.remove((kind, child))
            self.members[kind].append(child.spec)
            self.write_lists()
            op.joining[child.spec.address] = now + GATEWAY_ACK_S
            announce(f"{name} ({child.spec.address}) is serving; added to the gateway's {kind} list")
            return
        elif now > op.deadline:
            failure = f"{name} ({child.spec.address}) did not report SERVING within {self.startup_timeout_s:g} s"
        else:
            return
        op.starting.remove((kind, child))
        op.stopping += [c for c in self.sup.retire(name) if c.proc.poll() is None]
        op.failures.append(failure)
        announce(f"scaling {kind} up failed: {failure}")

    def _finish(self, op: _Op) -> None:
        members = self.membership()
        announce("workers now: " + " ".join(f"{kind}=[{','.join(addrs)}]" for kind, addrs in members.items()))
        if op.request is not None:
            op.request.reply({"ok": not op.failures, "error": "; ".join(op.failures), **members})

    # ---- what the gateway says (its forwarded log lines)

    def _listen_to_gateway(self) -> None:
        for child in self.sup.children:  # a restarted gateway is a new Child: listen to it too
            if child.spec.name == "gateway" and self._on_gateway_line not in child.listeners:
                child.listeners.append(self._on_gateway_line)

    def _on_gateway_line(self, line: str) -> None:
        """On the output forwarder's thread: a set's add is atomic, nothing more is done here."""
        found = _GATEWAY_SAYS.search(line)
        if found:
            self._gateway_said.add((found.group(2), found.group(3)))

    def _said(self, address: str, what: str) -> bool:
        if (address, what) in self._gateway_said:
            self._gateway_said.discard((address, what))
            return True
        return False
