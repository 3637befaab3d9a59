"""`pdserve up`: the whole stack on one machine, one child process per service.

Starts the kvstore, N prefill and M decode workers on free loopback ports and waits until each
one's grpc health check says SERVING; then starts the gateway on --grpc-port (so its first probe
finds the workers healthy) and waits for it too. It then prints exactly one line on stdout:

    pdserve ready: grpc=127.0.0.1:50051 http=127.0.0.1:8000 prefill=[...] decode=[...] kvstore=...

`http=` is where the gateway serves the OpenAI-compatible HTTP API and the chat page
(--http-port; `http=off` when it is 0).

With --config FILE it starts every deployment of the file instead (each with its own kvstore,
prefill and decode workers; see `pdserve.deploy_plan` and docs/experiments.md) and one gateway over
all of them; the file is validated before anything starts.

Before starting anything it checks every port the stack will bind (the gateway's gRPC and HTTP
ports, each worker's, the kvstore's, the metrics ports) and refuses with one line naming a taken one
and, where /proc tells, the process that holds it (exit 2).

Secure by default: every child gets a random internal token (unless PDSERVE_INTERNAL_TOKEN(_FILE)
is set, or --no-internal-token) and the prefill and decode workers a random KV MAC key (unless
PDSERVE_KV_MAC_KEY(_FILE) is set), in their environment (`_with_cluster_secrets`, docs/security.md).

Everything the children print goes to stderr, each line prefixed with the child's name; `up` logs
each child's pid as it starts it. Each child runs in its own process group; SIGINT/SIGTERM stop them
all (SIGTERM to the group, SIGKILL after --grace-period) and `up` exits 0. A child that exits, or
does not come up in --startup-timeout, during start-up stops the rest, and `up` exits 1 with a
message naming it and its last output. Once ready, `up` is a supervisor: a child that dies is logged
(its exit and the delay) and restarted on its address with exponential back-off (RestartPolicy);
only a signal stops `up`. Children exit when `up` dies, even by SIGKILL (pdserve/parent_watch.py).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve import parent_watch
from pdserve.tls import TlsConfig

NAME = "up"
HELP = "run kvstore, prefill and decode workers and the gateway as local child processes"

POLL_S = 0.2
TAIL_LINES = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or HF checkpoint directory (default: $PDSERVE_MODEL, else the bundled stories260K)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--grpc-port", type=int, default=50051, help="the gateway's gRPC port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the gateway's OpenAI-compatible HTTP API and chat page (0 disables it)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per worker (0: torch's default)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8", "fp8_e4m3"])
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences per decode step")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in each worker's paged cache")
    p.add_argument("--max-batched-tokens", type=int, default=0,
                   help="token budget of one engine step in each worker (0: the workers' default); smaller"
                        " chunks let short prompts pass long ones sooner")
    p.add_argument("--kvstore-capacity-mb", type=float, default=1024, help="memory of the kvstore")
    p.add_argument("--kv-backend", default=os.environ.get("PDSERVE_KV_BACKEND", "memory"),
                   help="the kvstore's second tier: memory (none) or redis://host:port/db")
    p.add_argument("--max-inflight", type=int, default=256, help="the gateway's in-flight request limit")
    p.add_argument("--metrics-port-base", type=int, default=0,
                   help="serve each child's Prometheus /metrics on consecutive ports from this one (0: off)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds each phase may take to report SERVING")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the children")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of named deployments and A/B experiments (docs/experiments.md): starts "
                        "every deployment's kvstore and workers and one gateway over all of them; "
                        "--prefill/--decode/--num-blocks are the defaults of deployments that set none")
    p.add_argument("--experiment-seed", type=int, default=None,
                   help="with --config: seed of the gateway's random arm choices")
    p.add_argument("--internal-token", action=argparse.BooleanOptionalAction, default=True,
                   help="generate a random internal token for the children when PDSERVE_INTERNAL_TOKEN(_FILE) "
                        "is unset (default); --no-internal-token leaves the internal ports open to any local "
                        "process (debugging with grpcurl; the test stack). A KV MAC key is generated likewise "
                        "when PDSERVE_KV_MAC_KEY(_FILE) is unset (docs/security.md)")
    from gateway import deadlines, disagg

    disagg.add_arguments(p, decode_batch_flag=False)  # forwarded to the gateway, with --max-batch-size
    deadlines.add_arguments(p)  # forwarded to the gateway


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

    def last_output(self) -> str:
        return "\n".join(f"    {line}" for line in self.tail) or "    (no output)"


class StartupError(RuntimeError):
    """A child did not come up; the message names it and shows its last output."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def ports_needed(args: argparse.Namespace, workers: Sequence[ChildSpec],
                 gateway: ChildSpec) -> list[tuple[str, str, int]]:
    """(what, host, port) of every port the stack binds, `what` naming it for a person. The workers'
    ports were free when plan() drew them, but another process may have taken one since."""
    needed = [(f"--grpc-port {args.grpc_port}", args.host, args.grpc_port)]
    if args.http_port:
        needed.append((f"--http-port {args.http_port}", args.host, args.http_port))
    for spec in workers:
        host, port = spec.address.rsplit(":", 1)
        needed.append((f"port {port} ({spec.name})", host, int(port)))
    for spec in [*workers, gateway]:
        metrics = dict(spec.env).get("PDSERVE_METRICS_PORT")
        if metrics:  # served on every interface (pdserve/grpc_server.py)
            needed.append((f"port {metrics} (metrics of {spec.name}, --metrics-port-base)", "0.0.0.0", int(metrics)))
    return needed


def taken_port(needed: Sequence[tuple[str, str, int]]) -> str | None:
    """One line naming the first port of `needed` that is taken and who holds it; None if all are free."""
    for what, host, port in needed:
        busy = port_in_use(host, port)
        if busy:
            holder = port_holder(port)
            return f"cannot use {what} on {host}: {busy}" + (f", held by {holder}" if holder else "")
    return None


def plan(args: argparse.Namespace) -> tuple[list[ChildSpec], ChildSpec]:
    """The workers (with the kvstore) to start first, and the gateway to start once they serve."""
    if getattr(args, "config", None):  # every deployment of the file: pdserve.deploy_plan
        from pdserve.deploy_plan import plan_config

        workers, gateway = plan_config(args)
        if args.metrics_port_base:
            workers, gateway = _with_metrics_ports([*workers, gateway], args.metrics_port_base)
        return _with_cluster_secrets(workers, gateway, getattr(args, "internal_token", True))
    from gateway import deadlines, disagg

    loopback = "127.0.0.1"
    kv = f"{loopback}:{free_port()}"
    model = ("--model", args.model) if args.model else ()
    engine = (*model, "--block-size", str(args.block_size), "--kv-dtype", args.kv_dtype,
              "--num-blocks", str(args.num_blocks), *(("--threads", str(args.threads)) if args.threads else ()),
              *(("--max-batched-tokens", str(args.max_batched_tokens)) if args.max_batched_tokens else ()))
    workers = [ChildSpec("kvstore", kv, pdserve_command(
        "kvstore", "--bind", kv, "--capacity-mb", str(args.kvstore_capacity_mb),
        "--kv-backend", args.kv_backend))]
    for kind, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            addr = f"{loopback}:{free_port()}"
            extra = ("--max-batch-size", str(args.max_batch_size)) if kind == "decode" else ()
            workers.append(ChildSpec(f"{kind}-{i}", addr, pdserve_command(
                kind, "--bind", addr, "--kvstore", kv, *engine, *extra)))
    gw = f"{args.host}:{args.grpc_port}"
    gateway = ChildSpec("gateway", gw, pdserve_command(
        "gateway", "--bind", gw, "--kvstore", kv, *model, "--block-size", str(args.block_size),
        "--kv-dtype", args.kv_dtype, "--max-inflight", str(args.max_inflight),
        "--http-port", str(args.http_port),
        "--prefill", ",".join(w.address for w in workers if w.name.startswith("prefill")),
        "--decode", ",".join(w.address for w in workers if w.name.startswith("decode")),
        *disagg.gateway_flags(args, args.max_batch_size), *deadlines.gateway_flags(args)))
    if args.metrics_port_base:
        workers, gateway = _with_metrics_ports([*workers, gateway], args.metrics_port_base)
    return _with_cluster_secrets(workers, gateway, getattr(args, "internal_token", True))


def cluster_secret_env(environ: Mapping[str, str], internal_token: bool = True) -> dict[str, str]:
    """Secrets to generate for the children, those `environ` does not set already: a random internal
    token (unless `internal_token` is False) and a random KV MAC key. Secure by default: without
    them any local process could call the internal services and forge KV blocks."""
    from pdserve import internal_auth, kv_mac

    def unset(*names: str) -> bool:
        return not any(environ.get(n, "").strip() for n in names)
    env = {}
    if internal_token and unset(internal_auth.TOKEN_ENV, internal_auth.TOKEN_FILE_ENV):
        env[internal_auth.TOKEN_ENV] = secrets.token_urlsafe(32)
    if unset(kv_mac.KEY_ENV, kv_mac.KEY_FILE_ENV):
        env[kv_mac.KEY_ENV] = kv_mac.generate_key()
    return env


def _with_cluster_secrets(workers: list[ChildSpec], gateway: ChildSpec,
                          internal_token: bool) -> tuple[list[ChildSpec], ChildSpec]:
    """Every child gets the internal token; only prefill and decode workers get the KV MAC key
    (the kvstore and the gateway never read block contents, so they never hold it)."""
    from pdserve.kv_mac import KEY_ENV

    generated = cluster_secret_env(os.environ, internal_token)

    def add(spec: ChildSpec) -> ChildSpec:
        reads_blocks = spec.command[3] in ("prefill", "decode")  # pdserve_command: python -m pdserve.cli KIND
        extra = tuple((k, v) for k, v in generated.items() if reads_blocks or k != KEY_ENV)
        return replace(spec, env=(*spec.env, *extra))
    return [add(w) for w in workers], add(gateway)


def _with_metrics_ports(specs: list[ChildSpec], base: int) -> tuple[list[ChildSpec], ChildSpec]:
    """One PDSERVE_METRICS_PORT per child, consecutive from `base` (the gateway last)."""
    numbered = [replace(spec, env=(*spec.env, ("PDSERVE_METRICS_PORT", str(base + i))))
                for i, spec in enumerate(specs)]
    return numbered[:-1], numbered[-1]


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
        self.stop_requested = False  # set by the signal handler; polled (no locks in handlers)
        self._death_pipe = os.pipe()  # never written: children watch its read end for EOF

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
            pending = [c for c in pending if not _check_serving(c, timeout_s=1.0)]
            if pending and time.monotonic() > deadline:
                c = pending[0]
                raise StartupError(f"{c.spec.name} ({c.spec.address}) did not report SERVING within "
                                   f"{timeout_s:g} s; its last output:\n{c.last_output()}")
            if pending:
                time.sleep(POLL_S)
        return True

    def watch(self) -> Child | None:
        """Block until a stop is requested (None). A child that exits is returned, or, with a restart
        policy, restarted on its address after its back-off delay, and watching goes on."""
        while not self.stop_requested:
            dead = self.dead_child()
            if dead is not None and self.restart is None:
                return dead
            if dead is not None:
                self._schedule_restart(dead, self.restart)
            self._start_due_restarts()
            self._note_serving_again()
            time.sleep(POLL_S)
        return None

    def _schedule_restart(self, dead: Child, policy: RestartPolicy) -> None:
        now = time.monotonic()
        served_s = now - dead.served_at if dead.served_at is not None else 0.0
        delay = policy.next_delay(dead.backoff_s, served_s)
        self.children.remove(dead)
        self.restarting.append((now + delay, delay, dead))
        when = (f"after serving {served_s:.0f} s" if dead.served_at is not None
                else f"{now - dead.started_at:.1f} s after it started, before it reported SERVING")
        _log(f"{describe_exit(dead)} {when}; restarting it in {delay:g} s (restart {dead.restarts + 1})")

    def _start_due_restarts(self) -> None:
        now = time.monotonic()
        for entry in [e for e in self.restarting if e[0] <= now]:
            self.restarting.remove(entry)
            _, delay, dead = entry
            new = self.start(dead.spec, restarts=dead.restarts + 1, backoff_s=delay)
            _log(f"restarted {dead.spec.name} ({dead.spec.address}) as pid {new.proc.pid}")

    def _note_serving_again(self) -> None:
        """Log a restarted child's return once its health check says SERVING (this also starts the
        time after which its next death backs off from the first delay again)."""
        for child in self.children:
            if child.restarts and child.served_at is None and child.proc.poll() is None \
                    and _check_serving(child, timeout_s=0.5):
                _log(f"{child.spec.name} ({child.spec.address}) is serving again after restart {child.restarts}")

    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL the ones still there after the grace period."""
        self.restarting.clear()
        for child in self.children:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in self.children:
            try:
                child.proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                print(f"pdserve up: {child.spec.name} ignored SIGTERM for {self.grace_s:g} s; killing it",
                      file=sys.stderr)
                _signal_group(child, signal.SIGKILL)
                child.proc.wait()


def _log(message: str) -> None:
    print(f"pdserve up: {message}", file=sys.stderr, flush=True)


def _check_serving(child: Child, timeout_s: float) -> bool:
    """Whether the child's health check says SERVING; stamps `served_at` the first time it does."""
    from pdserve.healthcheck import is_serving

    if not is_serving(child.spec.address, timeout_s=timeout_s, config=_tls_of(child)):
        return False
    if child.served_at is None:
        child.served_at = time.monotonic()
    return True


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


def describe_exit(child: Child) -> str:
    """E.g. "decode-0 (127.0.0.1:4000) was killed by signal 9"."""
    code = child.proc.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{child.spec.name} ({child.spec.address}) {how}"


def ready_line(args: argparse.Namespace, workers: Sequence[ChildSpec], gateway: ChildSpec) -> str:
    def addrs(kind: str) -> str:
        return ",".join(w.address for w in workers if w.name.startswith(kind))
    http = f"{args.host}:{args.http_port}" if args.http_port else "off"
    metrics = (f" metrics={args.metrics_port_base}-{args.metrics_port_base + len(workers)}"
               if args.metrics_port_base else "")
    return (f"pdserve ready: grpc={gateway.address} http={http} "
            f"prefill=[{addrs('prefill')}] decode=[{addrs('decode')}] kvstore={addrs('kvstore')}{metrics}")


def run(args: argparse.Namespace) -> int:
    refusal = _refusal(args)
    if refusal is None:
        workers, gateway = plan(args)
        refusal = taken_port(ports_needed(args, workers, gateway))
    if refusal is not None:
        print(f"pdserve up: {refusal}", file=sys.stderr)
        return 2
    sup = Supervisor(args.grace_period, RestartPolicy())

    def request_stop(signum: int, frame: object) -> None:
        sup.stop_requested = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    try:
        return _run_stack(args, sup, workers, gateway)
    finally:
        sup.stop_all()


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags (or the --config file), checked before anything starts."""
    if args.prefill < 1 or args.decode < 1:
        return "--prefill and --decode need at least 1 worker each"
    if args.config:
        from gateway.experiments.serve_config import ExperimentConfigError, load_serve_config

        try:
            load_serve_config(args.config)
        except ExperimentConfigError as err:
            return f"{args.config}: {err}"
    if not 0 < args.grpc_port < 65536:
        return f"--grpc-port must be in 1..65535, got {args.grpc_port}"
    if not 0 <= args.http_port < 65536:
        return f"--http-port must be in 0..65535 (0 disables the HTTP API), got {args.http_port}"
    from gateway import deadlines

    try:
        deadlines.from_args(args)  # the gateway's timeouts, forwarded to it
    except ValueError as err:
        return str(err)
    return None


def _run_stack(args: argparse.Namespace, sup: Supervisor, workers: list[ChildSpec], gateway: ChildSpec) -> int:
    """Start the workers, then the gateway; print the ready line; supervise until a signal."""
    try:
        if not sup.wait_serving([_start_logged(sup, w) for w in workers], args.startup_timeout):
            return 0
        if not sup.wait_serving([_start_logged(sup, gateway)], args.startup_timeout):
            return 0
    except StartupError as err:
        print(f"pdserve up: {err}", file=sys.stderr)
        return 1
    print(ready_line(args, workers, gateway), flush=True)
    sup.watch()  # restarts children that die (RestartPolicy); returns once a signal asks to stop
    print("pdserve up: stopping", file=sys.stderr)
    return 0


def _start_logged(sup: Supervisor, spec: ChildSpec) -> Child:
    child = sup.start(spec)
    _log(f"started {spec.name} ({spec.address}) as pid {child.proc.pid}")
    return child
