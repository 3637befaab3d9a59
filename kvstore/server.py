"""Runs the KV store as a standalone gRPC server: `python -m kvstore.server --bind ... --capacity-mb ...`."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

import grpc

from kvstore.service import SERVICE_NAME, add_to_server
from kvstore.store import MemoryBlockStore
from pdserve.grpc_server import serve_until_signal, start_server

DEFAULT_BIND = "0.0.0.0:50070"


async def serve(bind: str, capacity_bytes: int, lease_ttl_s: float = 120.0
                ) -> tuple[grpc.aio.Server, int]:
    """Start a KV store server holding up to `capacity_bytes` of blocks; returns (server, port)."""
    store = MemoryBlockStore(capacity_bytes, lease_ttl_s=lease_ttl_s)
    return await start_server(bind, lambda server: add_to_server(store, server), [SERVICE_NAME])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore", description="pdserve KV block store")
    parser.add_argument("--bind", default=DEFAULT_BIND, help="host:port to listen on")
    parser.add_argument("--capacity-mb", type=float, default=1024, help="block data capacity in MiB")
    parser.add_argument("--lease-ttl-s", type=float, default=120.0,
                        help="a lease not used or released for this long is released")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    server, port = await serve(args.bind, int(args.capacity_mb * (1 << 20)), args.lease_ttl_s)
    logging.getLogger(__name__).info("kvstore listening on port %d", port)
    await serve_until_signal(server)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the KV store until SIGINT/SIGTERM, then stop gracefully."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
