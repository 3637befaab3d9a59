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

Everything the children print goes to stderr, each line prefixed with the child's name. Each
child runs in its own process group; SIGINT/SIGTERM stop them all (SIGTERM to the group, SIGKILL
after --grace-period) and `up` exits 0. A child that exits on its own, or does not come up in
--startup-timeout, stops the rest, and `up` exits 1 with a message naming it and its last output.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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
    from gateway import disagg

    disagg.add_arguments(p, decode_batch_flag=False)  # forwarded to the gateway, with --max-batch-size


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


@dataclass(eq=False)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    forwarder: threading.Thread | None = None

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


def plan(args: argparse.Namespace) -> tuple[list[ChildSpec], ChildSpec]:
    """The workers (with the kvstore) to start first, and the gateway to start once they serve."""
    if getattr(args, "config", None):  # every deployment of the file: pdserve.deploy_plan
        from pdserve.deploy_plan import plan_config

        workers, gateway = plan_config(args)
        return _with_metrics_ports([*workers, gateway], args.metrics_port_base) if args.metrics_port_base \
            else (workers, gateway)
    from gateway import disagg

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
        *disagg.gateway_flags(args, args.max_batch_size)))
    if args.metrics_port_base:
        workers, gateway = _with_metrics_ports([*workers, gateway], args.metrics_port_base)
    return workers, gateway


def _with_metrics_ports(specs: list[ChildSpec], base: int) -> tuple[list[ChildSpec], ChildSpec]:
    """One PDSERVE_METRICS_PORT per child, consecutive from `base` (the gateway last)."""
    numbered = [replace(spec, env=(*spec.env, ("PDSERVE_METRICS_PORT", str(base + i))))
                for i, spec in enumerate(specs)]
    return numbered[:-1], numbered[-1]


class Supervisor:
    """Starts children in their own process groups, forwards their output, and stops them all."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.stop_requested = False  # set by the signal handler; polled (no locks in handlers)

    def start(self, spec: ChildSpec) -> Child:
        proc = subprocess.Popen(
            spec.command, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **dict(spec.env)},
            start_new_session=True)  # its own process group: killpg reaches anything it spawns
        child = Child(spec, proc)
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
        from pdserve.healthcheck import is_serving

        pending = list(children)
        deadline = time.monotonic() + timeout_s
        while pending:
            if self.stop_requested:
                return False
            dead = self.dead_child()
            if dead is not None:
                raise StartupError(f"{describe_exit(dead)} while starting up; its last output:\n"
                                   f"{dead.last_output()}")
            pending = [c for c in pending if not is_serving(c.spec.address, timeout_s=1.0, config=_tls_of(c))]
            if pending and time.monotonic() > deadline:
                c = pending[0]
                raise StartupError(f"{c.spec.name} ({c.spec.address}) did not report SERVING within "
                                   f"{timeout_s:g} s; its last output:\n{c.last_output()}")
            if pending:
                time.sleep(POLL_S)
        return True

    def watch(self) -> Child | None:
        """Block until a stop is requested (None) or a child exits (that child)."""
        while not self.stop_requested:
            dead = self.dead_child()
            if dead is not None:
                return dead
            time.sleep(POLL_S)
        return None

    def stop_all(self) -> None:
        """SIGTERM every child's process group, SIGKILL the ones still there after the grace period."""
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
    if args.prefill < 1 or args.decode < 1:
        print("pdserve up: --prefill and --decode need at least 1 worker each", file=sys.stderr)
        return 2
    if args.config:
        from gateway.experiments.serve_config import ExperimentConfigError, load_serve_config

        try:
            load_serve_config(args.config)  # validated before anything starts
        except ExperimentConfigError as err:
            print(f"pdserve up: {args.config}: {err}", file=sys.stderr)
            return 2
    if not 0 <= args.http_port < 65536:
        print(f"pdserve up: --http-port must be in 0..65535 (0 disables the HTTP API), got {args.http_port}",
              file=sys.stderr)
        return 2
    ports = [("--grpc-port", args.grpc_port), *([("--http-port", args.http_port)] if args.http_port else [])]
    for flag, port in ports:
        busy = port_in_use(args.host, port)
        if busy:
            print(f"pdserve up: cannot use {flag} {port} on {args.host}: {busy}", file=sys.stderr)
            return 1
    sup = Supervisor(args.grace_period)

    def request_stop(signum: int, frame: object) -> None:
        sup.stop_requested = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    try:
        return _run_stack(args, sup)
    finally:
        sup.stop_all()


def _run_stack(args: argparse.Namespace, sup: Supervisor) -> int:
    workers, gateway = plan(args)
    try:
        if not sup.wait_serving([sup.start(w) for w in workers], args.startup_timeout):
            return 0
        if not sup.wait_serving([sup.start(gateway)], args.startup_timeout):
            return 0
    except StartupError as err:
        print(f"pdserve up: {err}", file=sys.stderr)
        return 1
    print(ready_line(args, workers, gateway), flush=True)
    dead = sup.watch()
    if dead is None:
        print("pdserve up: stopping", file=sys.stderr)
        return 0
    print(f"pdserve up: {describe_exit(dead)}; stopping the others. Its last output:\n{dead.last_output()}",
          file=sys.stderr)
    return 1
