"""Runs the gateway: `pdserve gateway` or `python -m gateway.server`.

`serve` loads the model's tokenizer and config (the weights are never read), builds the worker
pools and the request flow of one deployment, probes the workers once and starts the gRPC server.
`serve_config` does the same for every deployment of a config file (`--config`, see
docs/experiments.md) and adds its A/B experiments; both hand a `deployments.Catalog` to
`serve_catalog`. `build_flow` is the one place a deployment's `RequestFlow` is made. With
`http_bind` (`--http-port`, default 8000, 0 disables) the gateway also starts the
OpenAI-compatible HTTP API and chat page (`gateway.http`) over the same catalog, on the same
asyncio loop, before the gRPC server: once gRPC health says SERVING, the HTTP port answers too.

Settings: `run` builds the `gateway.config.GatewayConfig` once, from the flags and the environment;
every function here takes it as `settings` (default: GatewayConfig's defaults, for in-process
gateways) and hands each part the piece it needs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
import weakref
from typing import TYPE_CHECKING
from collections.abc import Sequence

import grpc

from gateway.config import DEFAULT_BIND, GatewayConfig  # noqa: F401 (DEFAULT_BIND: re-exported)
from gateway.config import add_arguments as add_config_arguments
from pdserve import thread_policy
from pdserve.grpc_server import serve_until_signal, start_server, stop_server

if TYPE_CHECKING:
    from gateway.deployments import Catalog, Deployment
    from gateway.experiments.serve_config import ServeConfig
    from gateway.flow import ModelInfo, RequestFlow
    from gateway.http.app import HttpServer
    from gateway.limits import InflightLimit
    from gateway.workers import WorkerPool
    from kvstore.client import KVStoreClient

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"
KVSTORE_TIMEOUT_S = 0.5  # the kvstore only gives hints here; never hold a request up for long

# What each server started here owns besides itself, closed by `stop`.
_owned: weakref.WeakKeyDictionary[grpc.aio.Server, list] = weakref.WeakKeyDictionary()
# The HTTP API started with each server (see `http_server`).
_http_of: weakref.WeakKeyDictionary[grpc.aio.Server, HttpServer] = weakref.WeakKeyDictionary()


async def serve(bind: str, prefill_targets: Sequence[str] | str, decode_targets: Sequence[str] | str,
                kvstore_target: str | None, model_path: str | None, block_size: int = 16,
                kv_dtype: str = "float32", max_inflight: int = 256, *, http_bind: str | None = None,
                model_name: str | None = None, dtype: str = "float32", settings: GatewayConfig | None = None
                ) -> tuple[grpc.aio.Server, int]:
    """Start the gateway over one deployment on `bind`; targets are `host:port` or
    `dns:///name:port` (a string may list several, comma-separated). Returns (server, port); stop
    it with `stop(server)`.

    `http_bind` ("host:port", port 0 picks one) also serves the HTTP API there; `http_server(server)`
    then tells its port. `model_name` is the id clients send as `model` (default: the checkpoint's
    file or directory name). `dtype` is the workers' compute dtype (it is part of the block hashes).
    `settings`: everything else (limits, deadlines, placement, keys, TLS, ...); the arguments
    before it are the deployment's, which `run` takes from the same settings."""
    from gateway.deployments import Catalog
    from gateway.limits import InflightLimit

    name = model_name or default_model_name(model_path)
    deployment = await start_deployment(name, model_path, block_size, kv_dtype, prefill_targets, decode_targets,
                                        kvstore_target, InflightLimit(max_inflight), dtype, settings)
    return await serve_catalog(bind, Catalog([deployment]), http_bind=http_bind, settings=settings)


async def serve_config(bind: str, config: ServeConfig, max_inflight: int = 256, *, http_bind: str | None = None,
                       seed: int | None = None, dtype: str = "float32", settings: GatewayConfig | None = None
                       ) -> tuple[grpc.aio.Server, int]:
    """Start the gateway over every deployment and experiment of `config` (its targets filled in);
    `seed` makes the experiments' arm choices reproducible; `dtype` is the workers' compute dtype;
    `settings` as for `serve`. Returns (server, port)."""
    from gateway.deployments import Catalog, Deployment
    from gateway.experiments.live import LiveExperiment
    from gateway.limits import InflightLimit

    config.require_targets()
    limit = InflightLimit(max_inflight)  # one gateway-wide bound over all deployments
    deployments: list[Deployment] = []
    try:
        for dep in config.deployments.values():
            deployments.append(await start_deployment(
                dep.name, dep.model, dep.block_size, dep.kv_dtype, dep.prefill_targets, dep.decode_targets,
                dep.kvstore_target, limit, dtype, settings))
    except BaseException:
        for started in deployments:
            await started.close()
        raise
    experiments = [LiveExperiment(cfg, seed=seed) for cfg in config.experiments.values()]
    return await serve_catalog(bind, Catalog(deployments, experiments, config.default_model), http_bind=http_bind,
                               settings=settings)


async def start_deployment(name: str, model_path: str | None, block_size: int, kv_dtype: str,
                           prefill_targets: Sequence[str] | str, decode_targets: Sequence[str] | str,
                           kvstore_target: str | None, limit: InflightLimit, dtype: str = "float32",
                           settings: GatewayConfig | None = None) -> Deployment:
    """One deployment: its model info, worker pools (probed once), kvstore client and request flow."""
    from gateway.deployments import Deployment
    from kvstore.client import KVStoreClient

    settings = settings or GatewayConfig()
    model = await asyncio.to_thread(load_model_info, model_path, block_size, kv_dtype, dtype)
    model = capped_model(model, settings.max_model_len, name)
    prefill = await _start_pool("prefill", prefill_targets, settings)
    decode = await _start_pool("decode", decode_targets, settings)
    kvstore = KVStoreClient(kvstore_target, timeout_s=KVSTORE_TIMEOUT_S) if kvstore_target else None
    return Deployment(name, build_flow(model, prefill, decode, kvstore, limit, settings))


def capped_model(model: ModelInfo, max_model_len: int | None, name: str = "") -> ModelInfo:
    """`model` with its context window capped at --max-model-len; ValueError when that is above
    the model's own (the workers could not run such a request)."""
    import dataclasses

    if max_model_len is None:
        return model
    check_max_model_len(max_model_len, model.context_window, name)
    return dataclasses.replace(model, context_window=max_model_len)


def check_max_model_len(max_model_len: int, context_window: int, name: str = "") -> None:
    """ValueError (one line, naming the flag) when --max-model-len is above the model's window."""
    if max_model_len > context_window:
        model = f"deployment {name!r}'s model" if name else "the model"
        raise ValueError(f"--max-model-len {max_model_len} is above the context window of {context_window} tokens "
                         f"of {model} (its max_position_embeddings); use at most {context_window}")


def key_ring(settings: GatewayConfig):  # -> auth.KeyRing | None
    """The API keys of --api-keys-file and --api-key together (None: no key, the API is open). A key
    given both ways keeps the file's name and limits."""
    from pathlib import Path

    from gateway import auth
    from gateway.key_limits import KeyLimits

    keys: list[auth.ApiKey] = []
    if settings.api_keys_file:
        try:
            text = Path(settings.api_keys_file).read_text()
        except OSError as err:
            raise ValueError(f"cannot read the API keys file {settings.api_keys_file}: {err.strerror or err}") from None
        keys = auth.parse_keys(text, settings.api_keys_file)
    for key in settings.api_keys:
        digest = auth.digest(key)
        if all(k.digest != digest for k in keys):
            keys.append(auth.ApiKey(f"key-{digest.hex()[:8]}", digest, KeyLimits()))
    return auth.KeyRing(keys) if keys else None


def build_flow(model: ModelInfo, prefill: WorkerPool, decode: WorkerPool, kvstore: KVStoreClient | None,
               limit: InflightLimit, settings: GatewayConfig | None = None) -> RequestFlow:
    """The request flow of one deployment (the one place a RequestFlow is built), with its own
    placement policy (the EWMAs of a conditional one learn this deployment's workers)."""
    from gateway.admission import admission_for
    from gateway.disagg import make_placement
    from gateway.flow import RequestFlow

    settings = settings or GatewayConfig()
    # SLO-aware admission under the cap when the admission SLO is set.
    admission = admission_for(limit, prefill.routable_count, settings.admission_ttft_slo_ms)
    return RequestFlow(model=model, prefill=prefill, decode=decode, kvstore=kvstore, limit=admission,
                       limits=settings.limits, placement=make_placement(settings.disagg_policy, settings.disagg),
                       deadlines=settings.deadlines, session_prefetch=settings.session_prefetch,
                       hot_prefix_min=settings.hot_prefix_min)


async def serve_catalog(bind: str, catalog: Catalog, *, http_bind: str | None = None,
                        settings: GatewayConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve `catalog` over gRPC on `bind` (and HTTP on `http_bind`); the server owns it from here.
    The API keys of `settings.api_keys_file` are read here, once, for both APIs."""
    from gateway import auth
    from gateway.service import GatewayServicer
    from pdserve.v1 import gateway_pb2_grpc

    settings = settings or GatewayConfig()
    http = None
    try:
        keys = key_ring(settings)
        servicer = GatewayServicer(catalog, settings=settings)
        limits = settings.limits
        if http_bind is not None:
            from gateway.http.app import create_app, start_http
            app = create_app(catalog, slo=servicer.slo, limits=limits, deadlines=settings.deadlines, keys=keys,
                             cors_config=settings.cors)
            http = await start_http(app, http_bind, header_timeout_s=limits.http_header_timeout_s,
                                    tls=settings.process.tls)
        # Public: API keys (gateway.auth) instead of the internal token; request size limit.
        server, port = await start_server(
            bind, lambda srv: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, srv), [SERVICE_NAME],
            public=True, interceptors=auth.grpc_interceptors(keys), max_receive_bytes=limits.max_request_bytes,
            process=settings.process)
    except BaseException:
        if http is not None:
            await http.close()
        await catalog.close()
        raise
    # HTTP first: its streams run on the pools and must end before the pools close.
    _owned[server] = [*([http] if http else []), catalog]
    if http is not None:
        _http_of[server] = http
    return server, port


def http_server(server: grpc.aio.Server) -> HttpServer | None:
    """The HTTP API started with `server` (its `port`), or None when it has none."""
    return _http_of.get(server)


def default_model_name(model_path: str | None) -> str:
    """The model id of the HTTP API: the checkpoint's file name without suffix and without a llama.cpp
    quantization tag ("SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"), or its directory's name."""
    from pdserve.runtime.loader import resolve_model_path

    path = resolve_model_path(model_path)
    return _QUANT_TAG.sub("", path.stem) if path.is_file() else path.name


# A llama.cpp file type at the end of a GGUF file's name: .Q4_1, -Q4_K_M, .f16, -IQ4_XS, .BF16, ...
_QUANT_TAG = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def http_bind_of(grpc_bind: str, http_port: int, host: str | None = None) -> str | None:
    """The HTTP API's "host:port": `host` (--host), else the gRPC bind's host, with `http_port`;
    None when the port is 0."""
    if http_port == 0:
        return None
    host = host or grpc_bind.rpartition(":")[0] or "127.0.0.1"
    return f"[{host}]:{http_port}" if ":" in host and not host.startswith("[") else f"{host}:{http_port}"


async def stop(server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    """Stop the server gracefully, then its worker pools and kvstore client."""
    await stop_server(server, grace_s)
    await _close_owned(server)


async def _close_owned(server: grpc.aio.Server) -> None:
    for resource in _owned.pop(server, []):
        await resource.close()


def load_model_info(model_path: str | None, block_size: int, kv_dtype: str, dtype: str = "float32") -> ModelInfo:
    """The gateway's view of the model: tokenizer, context window, fingerprint (with the workers'
    compute dtype in it, as theirs)."""
    from gateway.flow import ModelInfo
    from pdserve.runtime.block_names import BlockNames
    from pdserve.runtime.loader import compute_fingerprint, inspect_checkpoint, resolve_model_path

    info = inspect_checkpoint(resolve_model_path(model_path))  # the gateway never reads weights
    names = BlockNames(compute_fingerprint(info.fingerprint, dtype), kv_dtype, block_size)
    return ModelInfo(info.tokenizer, info.config.max_position_embeddings, names)


async def _start_pool(kind: str, targets: Sequence[str] | str, settings: GatewayConfig) -> WorkerPool:
    from gateway.retry import RetryBudget
    from gateway.targets import parse_target, parse_target_list
    from gateway.worker_calls import decode_stub, prefill_stub
    from gateway.workers import WorkerPool

    parsed = parse_target_list(targets) if isinstance(targets, str) else [parse_target(t) for t in targets]
    pool = WorkerPool(kind, parsed, prefill_stub if kind == "prefill" else decode_stub, breaker=settings.breaker,
                      retry_budget=RetryBudget(settings.retry_budget), unhealthy_after=settings.probe_failures)
    await pool.start()
    return pool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags (shared by `pdserve gateway` and `python -m gateway.server`): one per
    GatewayConfig setting (gateway.config), defaults shown in --help."""
    add_config_arguments(parser)


async def run_until_signal(settings: GatewayConfig) -> None:
    """Serve with `settings` until SIGINT/SIGTERM, then stop gracefully."""
    from pdserve.engine_args import resolved_dtypes

    http_bind = http_bind_of(settings.bind, settings.http_port, settings.http_host)
    dtype, kv_dtype = resolved_dtypes(settings.dtype, settings.kv_dtype)  # as the workers resolve theirs
    if settings.serve_config:
        from gateway.experiments.serve_config import load_serve_config

        config = load_serve_config(settings.serve_config).with_targets(settings.deployment_targets)
        server, port = await serve_config(settings.bind, config, settings.max_inflight, http_bind=http_bind,
                                          seed=settings.experiment_seed, dtype=dtype, settings=settings)
    else:
        if not settings.prefill or not settings.decode:
            raise ValueError("--prefill and --decode are required (or --config FILE with deployments)")
        if settings.deployment_targets:
            raise ValueError("--deployment-targets needs --config FILE")
        server, port = await serve(settings.bind, settings.prefill, settings.decode, settings.kvstore, settings.model,
                                   settings.block_size, kv_dtype, settings.max_inflight, http_bind=http_bind,
                                   model_name=settings.served_model_name, dtype=dtype, settings=settings)
    log.info("gateway listening on port %d", port)
    # Once it serves (not before: a gateway that fails to start leaves its caller's threads alone),
    # every thread it has, and those it starts later, which inherit it: all are service threads.
    thread_policy.apply(thread_policy.resolve(settings.process.service_threads, "batch"))
    try:
        await serve_until_signal(server)
    finally:
        await _close_owned(server)  # serve_until_signal stopped the server itself


def run(args: argparse.Namespace) -> int:
    """Build the settings (the flags and the environment, read here once) and serve until a signal;
    0 then, 2 with a one-line message when a setting or the model is bad."""
    from pdserve.runtime.loader import ModelLoadError

    try:
        settings = GatewayConfig.from_args(args, os.environ)
    except ValueError as err:
        print(f"pdserve gateway: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run_until_signal(settings))
    except (ValueError, OSError, ModelLoadError) as err:  # ExperimentConfigError is a ValueError
        print(f"pdserve gateway: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM."""
    from pdserve.cli import SafeArgumentParser  # no abbreviations, no secret in a usage error

    parser = SafeArgumentParser(prog="gateway", description="pdserve gateway")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
