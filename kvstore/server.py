"""Runs the KV store as a standalone gRPC server: `python -m kvstore.server --bind ... --capacity-mb ...`."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvstore.redis_tier import RedisTier
from kvstore.service import SERVICE_NAME, add_to_server
from kvstore.store import MemoryBlockStore
from kvstore.tiered import TieredStore
from pdserve.commands.kvstore import add_store_arguments
from pdserve import log_privacy
from pdserve.grpc_server import check_security_settings, serve_until_signal, start_server

DEFAULT_BIND = "127.0.0.1:50070"  # loopback unless told otherwise: the store trusts its writers


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How to build the store: memory capacity and watermarks, lease TTL, optional Redis tier."""

    capacity_bytes: int
    lease_ttl_s: float = 120.0
    high_watermark: float = 1.0
    low_watermark: float = 1.0
    backend: str = ""  # "" or "memory": no second tier; "redis://host:port/db": Redis
    backend_timeout_s: float = 0.5


def parse_backend(backend: str) -> str:
    """The Redis URL of a --kv-backend value, "" for none; ValueError for anything else."""
    if backend in ("", "memory"):
        return ""
    if backend.startswith(("redis://", "rediss://", "unix://")):
        return backend
    raise ValueError(f"--kv-backend must be 'memory' or redis://host:port/db, got {backend!r}")


def build_store(options: StoreOptions) -> TieredStore:
    memory = MemoryBlockStore(options.capacity_bytes, lease_ttl_s=options.lease_ttl_s,
                              high_watermark=options.high_watermark, low_watermark=options.low_watermark)
    url = parse_backend(options.backend)
    redis = RedisTier(url, timeout_s=options.backend_timeout_s) if url else None
    return TieredStore(memory, redis)


async def serve_store(bind: str, options: StoreOptions) -> tuple[grpc.aio.Server, int, TieredStore]:
    """Start a KV store server; returns (server, port, store). Close the store after the server."""
    store = await build_store(options).start()
    server, port = await start_server(bind, lambda server: add_to_server(store, server), [SERVICE_NAME])
    return server, port, store


async def serve(bind: str, capacity_bytes: int, lease_ttl_s: float = 120.0
                ) -> tuple[grpc.aio.Server, int]:
    """Start a memory-only KV store server holding up to `capacity_bytes` of blocks; returns (server, port)."""
    server, port, _ = await serve_store(bind, StoreOptions(capacity_bytes, lease_ttl_s))
    return server, port


def options_from_args(args: argparse.Namespace) -> StoreOptions:
    parse_backend(args.kv_backend)  # bad values fail before anything starts
    check_security_settings()
    return StoreOptions(int(args.capacity_mb * (1 << 20)), args.lease_ttl_s, args.high_watermark,
                        args.low_watermark, args.kv_backend, args.backend_timeout_ms / 1000)


async def run_until_signal(bind: str, options: StoreOptions) -> None:
    server, port, store = await serve_store(bind, options)
    backend = log_privacy.url(parse_backend(options.backend)) or "none"
    logging.getLogger("kvstore").info("kvstore listening on port %d (redis tier: %s)", port, backend)
    try:
        await serve_until_signal(server)
    finally:
        await store.flush(timeout_s=2.0)
        await store.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore", description="pdserve KV block store", allow_abbrev=False)
    parser.add_argument("--bind", default=DEFAULT_BIND, help="host:port to listen on")
    add_store_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the KV store until SIGINT/SIGTERM, then stop gracefully."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_until_signal(args.bind, options_from_args(args)))


if __name__ == "__main__":
    main()
