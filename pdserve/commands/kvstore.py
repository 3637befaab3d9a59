"""`pdserve kvstore`: run the KV block store service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

NAME = "kvstore"
HELP = "run the KV store service (content-addressed KV blocks, LRU, leases)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default="0.0.0.0:50070", help="host:port to serve gRPC on")
    p.add_argument("--capacity-mb", type=float, default=1024, help="memory for KV blocks")
    p.add_argument("--lease-ttl-s", type=float, default=120.0,
                   help="a request's pins expire this long after its last use")


def run(args: argparse.Namespace) -> int:
    from kvstore.server import serve
    from pdserve.grpc_server import serve_until_signal

    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s kvstore %(levelname)s %(message)s")

    async def main() -> None:
        server, port = await serve(args.bind, int(args.capacity_mb * (1 << 20)), args.lease_ttl_s)
        logging.getLogger("kvstore").info("kvstore listening on port %d", port)
        await serve_until_signal(server)

    asyncio.run(main())
    return 0
