"""The child processes of `pdserve up --config FILE`: every deployment's workers, and one gateway.

Each deployment of the file gets its own kvstore and its own prefill and decode workers, started
with that deployment's model, block size and KV dtype:

    kvstore-<name>, prefill-<name>-<i>, decode-<name>-<i>    (for each deployment, in file order)
    gateway                                                  (--config FILE --deployment-targets ...)

A kvstore per deployment keeps KV namespaces apart by construction (block hashes already include
the model fingerprint and KV dtype, so a shared store would not mix blocks either, but separate
stores also keep one deployment's traffic from evicting another's blocks). The gateway reads the
same file and is told the addresses by `--deployment-targets`, so the file stays as written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gateway import deadlines
from gateway.experiments.serve_config import DeploymentConfig, ServeConfig, load_serve_config, target_flag
from pdserve.ports import free_port
from pdserve.supervisor import ChildSpec, pdserve_command

LOOPBACK = "127.0.0.1"


def _address() -> str:
    return f"{LOOPBACK}:{free_port()}"


def deployment_children(args: argparse.Namespace, dep: DeploymentConfig, threads: int) -> list[ChildSpec]:
    """The kvstore, prefill and decode workers of one deployment, `threads` torch threads each."""
    kv = _address()
    engine = ("--model", dep.model, "--block-size", str(dep.block_size), "--kv-dtype", dep.kv_dtype,
              "--num-blocks", str(dep.num_blocks or args.num_blocks), "--threads", str(threads),
              *(("--max-batched-tokens", str(args.max_batched_tokens)) if getattr(args, "max_batched_tokens", 0) else ()))
    children = [ChildSpec(f"kvstore-{dep.name}", kv, pdserve_command(
        "kvstore", "--bind", kv, "--capacity-mb", str(args.kvstore_capacity_mb), "--kv-backend", args.kv_backend))]
    for kind, count in (("prefill", dep.prefill or args.prefill), ("decode", dep.decode or args.decode)):
        for i in range(count):
            addr = _address()
            extra = ("--max-batch-size", str(args.max_batch_size)) if kind == "decode" else ()
            children.append(ChildSpec(f"{kind}-{dep.name}-{i}", addr, pdserve_command(
                kind, "--bind", addr, "--kvstore", kv, *engine, *extra)))
    return children


def target_flags(dep: DeploymentConfig, children: list[ChildSpec]) -> list[str]:
    """`--deployment-targets` flags telling the gateway where this deployment's children listen."""
    flags = []
    for kind in ("prefill", "decode", "kvstore"):
        addresses = [c.address for c in children if c.name.startswith(f"{kind}-")]
        flags += ["--deployment-targets", target_flag(dep.name, kind, addresses)]
    return flags


def plan_config(args: argparse.Namespace, config: ServeConfig | None = None) -> tuple[list[ChildSpec], ChildSpec]:
    """The workers of every deployment of `args.config`, and the gateway to start once they serve."""
    config = config or load_serve_config(args.config)
    workers: list[ChildSpec] = []
    flags: list[str] = []
    threads = args.threads or _threads_per_worker(args, config)
    for dep in config.deployments.values():
        children = deployment_children(args, dep, threads)
        workers += children
        flags += target_flags(dep, children)
    seed = getattr(args, "experiment_seed", None)
    gw = f"{args.host}:{args.grpc_port}"
    gateway = ChildSpec("gateway", gw, pdserve_command(
        "gateway", "--bind", gw, "--config", str(Path(args.config).resolve()), "--max-inflight", str(args.max_inflight),
        "--http-port", str(args.http_port), *flags, *(("--experiment-seed", str(seed)) if seed is not None else ()),
        *_placement_flags(args), *deadlines.gateway_flags(args)))
    return workers, gateway


def _threads_per_worker(args: argparse.Namespace, config: ServeConfig) -> int:
    """This host's cores divided among every deployment's worker processes, at least 1 (why:
    `pdserve.commands.up.worker_threads`)."""
    from pdserve.runtime.compute_threads import default_threads

    processes = sum((dep.prefill or args.prefill) + (dep.decode or args.decode) for dep in config.deployments.values())
    return max(1, default_threads() // max(processes, 1))


def _placement_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """`pdserve up`'s prefill placement flags, forwarded to the gateway (every deployment's policy)."""
    if not hasattr(args, "disagg_policy"):  # a plan built outside `pdserve up`
        return ()
    from gateway import disagg

    return disagg.gateway_flags(args, args.max_batch_size)
