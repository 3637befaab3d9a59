"""A real pdserve stack started in-process: kvstore, prefill and decode workers and the gateway, each
its own process on loopback, with `pdserve up`'s plan and supervisor (tests and benchmarks).

Unlike under `pdserve up`, the supervisor here has no restart policy: a child killed by Stack.kill
(or by a crash) stays dead until Stack.restart, so tests and `pdserve soak` decide every restart.
The children still exit if the process that started them dies (pdserve/parent_watch.py)."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from pdserve.cli import build_parser
from pdserve.commands.up import core_share_file, plan
from pdserve.control import make_private_dir
from pdserve.ports import free_port
from pdserve.supervisor import Child, ChildSpec, StartupError, Supervisor
from pdserve.v1 import gateway_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc


BIND_ATTEMPTS = 3  # starts of a stack whose child found its port taken (start_stack)


@dataclass
class Stack:
    supervisor: Supervisor
    gateway: Child
    workers: list[Child]
    args: argparse.Namespace  # the `pdserve up` flags it was started with

    def child(self, name: str) -> Child:
        """A worker (or the kvstore) by name, or the gateway ("gateway")."""
        return next(c for c in [*self.workers, self.gateway] if c.spec.name == name)

    @property
    def gateway_address(self) -> str:
        return self.gateway.spec.address

    @property
    def http_url(self) -> str | None:
        """http://host:port of the gateway's HTTP API, None when it is off."""
        if not self.args.http_port:
            return None
        return f"http://{self.args.host}:{self.args.http_port}"

    def gateway_stub(self) -> gateway_pb2_grpc.GatewayStub:
        return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(self.gateway_address))

    def kvstore_stats(self) -> kvstore_pb2.KVStoreStats:
        with grpc.insecure_channel(self.child("kvstore").spec.address) as ch:
            return kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.KVStoreStatsRequest(), timeout=5)

    def kvstore_stub(self, channel: grpc.Channel) -> kvstore_pb2_grpc.KVStoreStub:
        return kvstore_pb2_grpc.KVStoreStub(channel)

    def worker_stats(self, name: str) -> worker_pb2.WorkerStats:
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else worker_pb2_grpc.DecodeWorkerStub
        with grpc.insecure_channel(self.child(name).spec.address) as ch:
            return stub_cls(ch).Stats(worker_pb2.StatsRequest(), timeout=5)

    def kill(self, name: str) -> None:
        """SIGKILL one worker, as a crash would."""
        child = self.child(name)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(timeout=10)

    def restart(self, name: str, timeout_s: float = 180) -> Child:
        """Start a killed (or exited) child again with its old command and address; wait until it
        serves. The new Child replaces the old one here and in the supervisor."""
        old = self.child(name)
        if old.proc.poll() is None:
            raise RuntimeError(f"{name} is still running; kill it before restarting it")
        # Dead children (this one, others killed before) would make wait_serving report failure.
        self.supervisor.children = [c for c in self.supervisor.children if c.proc.poll() is None]
        new = self.supervisor.start(old.spec)
        if old is self.gateway:
            self.gateway = new
        else:
            self.workers[self.workers.index(old)] = new
        self.supervisor.wait_serving([new], timeout_s=timeout_s)
        return new

    def stop(self) -> None:
        self.supervisor.stop_all()
        share = core_share_file(self.args)
        share.unlink(missing_ok=True)
        try:
            share.parent.rmdir()
        except OSError:
            pass  # not empty: a control socket or list files of their own


def start_stack(prefill: int = 2, decode: int = 2, *extra: str, env: Mapping[str, str] | None = None,
                list_dir: Path | None = None) -> Stack:
    """Start the stack; `extra` are more `pdserve up` flags, `env` more environment of every child
    (e.g. PDSERVE_TLS_*: the health checks then dial as the children serve). The HTTP API is off
    unless `extra` passes `--http-port PORT`: a fixed default port would collide between concurrent stacks.
    As under `pdserve up` the workers get a generated KV MAC key; unlike it, no internal token is
    generated unless `extra` passes `--internal-token` (tests dial the internal ports directly).
    With `list_dir` the gateway reads its workers from list files there, as under `pdserve up`
    (pdserve.membership: rewrite them to change its membership).

    The ports it picks are free when picked and bound seconds later, by then maybe taken (the
    workers' own connections draw from the same ephemeral range): a child that cannot bind its port
    has the whole stack started again on new ports, up to BIND_ATTEMPTS times."""
    for _ in range(BIND_ATTEMPTS - 1):
        try:
            return _start_stack_once(prefill, decode, extra, env, list_dir)
        except StartupError as err:
            if "Address already in use" not in str(err):
                raise
    return _start_stack_once(prefill, decode, extra, env, list_dir)


def _start_stack_once(prefill: int, decode: int, extra: tuple[str, ...], env: Mapping[str, str] | None,
                      list_dir: Path | None) -> Stack:
    args = build_parser().parse_args([
        "up", "--prefill", str(prefill), "--decode", str(decode), "--grpc-port", str(free_port()),
        "--threads", "1", "--http-port", "0", "--no-internal-token", *extra])
    workers, gateway = plan(args)
    if list_dir is not None:
        from pdserve.membership import KINDS, gateway_on_list_files, list_file, write_list_file

        for kind in KINDS:
            write_list_file(list_file(list_dir, kind), [w.address for w in workers if w.name.startswith(f"{kind}-")])
        gateway = gateway_on_list_files(gateway, list_dir)
    if env:
        workers = [replace(w, env=(*w.env, *env.items())) for w in workers]
        gateway = replace(gateway, env=(*gateway.env, *env.items()))
    return start_planned(workers, gateway, args)


def start_planned(workers: list[ChildSpec], gateway: ChildSpec, args: argparse.Namespace) -> Stack:
    """Start planned children (`up.plan`'s, maybe changed): the workers, once they serve the
    gateway, once it serves the Stack; a child that fails to serve stops them all."""
    make_private_dir(core_share_file(args).parent)  # as `up` makes it: the workers share the cores through it
    sup = Supervisor(grace_s=5.0)
    try:
        children = [sup.start(spec) for spec in workers]
        sup.wait_serving(children, timeout_s=180)
        gw = sup.start(gateway)
        sup.wait_serving([gw], timeout_s=180)
    except BaseException:
        sup.stop_all()
        raise
    return Stack(sup, gw, children, args)
