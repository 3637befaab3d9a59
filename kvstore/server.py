"""Runs the KV store as a standalone gRPC server: `python -m kvstore.server --bind ... --capacity-mb ...`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import grpc

from kvstore.config import DEFAULT_BIND, KVStoreConfig, add_arguments, parse_backend  # noqa: F401 (re-exported)
from kvstore.redis_tier import RedisTier
from kvstore.service import SERVICE_NAME, add_to_server
from kvstore.store import MemoryBlockStore
from kvstore.tiered import TieredStore
from pdserve import log_privacy
from pdserve import thread_policy
from pdserve.grpc_server import ProcessConfig, serve_until_signal, start_server


def build_store(config: KVStoreConfig) -> TieredStore:
    memory = MemoryBlockStore(config.capacity_bytes, lease_ttl_s=config.lease_ttl_s,
                              high_watermark=config.high_watermark, low_watermark=config.low_watermark)
    url = config.redis_url
    redis = RedisTier(url, timeout_s=config.backend_timeout_s) if url else None
    return TieredStore(memory, redis)


async def serve_store(config: KVStoreConfig) -> tuple[grpc.aio.Server, int, TieredStore]:
    """Start a KV store server as `config` says; returns (server, port, store). Close the store
    after the server."""
    store = await build_store(config).start()
    server, port = await start_server(config.bind, lambda server: add_to_server(store, server), [SERVICE_NAME],
                                      process=config.process)
    return server, port, store


async def serve(bind: str, capacity_bytes: int, lease_ttl_s: float = 120.0, *,
                process: ProcessConfig | None = None) -> tuple[grpc.aio.Server, int]:
    """Start a memory-only KV store server holding up to `capacity_bytes` of blocks (the other
    settings KVStoreConfig's defaults, `process` its TLS and token); returns (server, port)."""
    config = KVStoreConfig(bind=bind, capacity_bytes=capacity_bytes, lease_ttl_s=lease_ttl_s,
                           process=process or ProcessConfig())
    server, port, _ = await serve_store(config)
    return server, port


async def run_until_signal(config: KVStoreConfig) -> None:
    server, port, store = await serve_store(config)
    backend = log_privacy.url(config.redis_url) or "none"
    logging.getLogger("kvstore").info("kvstore listening on port %d (redis tier: %s)", port, backend)
    # Once it serves, every thread it has and starts later (which inherit it): all are service threads.
    thread_policy.apply(thread_policy.resolve(config.process.service_threads, "batch"))
    try:
        await serve_until_signal(server)
    finally:
        await store.flush(timeout_s=2.0)
        await store.close()


def run(args: argparse.Namespace, log_format: str = "%(asctime)s kvstore %(levelname)s %(message)s") -> int:
    """Build the config (the flags and the environment, read here once) and serve until a signal;
    0 then, 2 with a one-line message when a setting is bad."""
    try:
        config = KVStoreConfig.from_args(args, os.environ)
    except ValueError as err:
        print(f"pdserve kvstore: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format=log_format)
    asyncio.run(run_until_signal(config))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore", description="pdserve KV block store", allow_abbrev=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the KV store until SIGINT/SIGTERM, then stop gracefully."""
    return run(parse_args(argv), log_format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    raise SystemExit(main())
