"""`pdserve kvstore`: run the KV block store service (memory tier, optional Redis tier)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

NAME = "kvstore"
HELP = "run the KV store service (content-addressed KV blocks, LRU, leases, optional Redis tier)"
BACKEND_ENV = "PDSERVE_KV_BACKEND"  # default of --kv-backend
DEFAULT_BIND = "127.0.0.1:50070"  # loopback unless told otherwise (as kvstore.server)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=DEFAULT_BIND, help="host:port to serve gRPC on (default loopback only; "
                   "0.0.0.0:50070 serves every interface)")
    add_store_arguments(p)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `pdserve kvstore` and `python -m kvstore.server`."""
    parser.add_argument("--capacity-mb", type=float, default=1024, help="memory tier: block data capacity in MiB")
    parser.add_argument("--lease-ttl-s", type=float, default=120.0,
                        help="a lease not used or released for this long is released")
    parser.add_argument("--high-watermark", type=float, default=0.95,
                        help="memory tier: start evicting when a put would go above this fraction of capacity")
    parser.add_argument("--low-watermark", type=float, default=0.85,
                        help="memory tier: evict down to this fraction of capacity")
    parser.add_argument("--kv-backend", default=os.environ.get(BACKEND_ENV, "memory"),
                        help="second tier: 'memory' (none) or redis://host:port/db "
                             f"(default: ${BACKEND_ENV}, else memory)")
    parser.add_argument("--backend-timeout-ms", type=float, default=500,
                        help="a Redis call slower than this counts as an outage")


def run(args: argparse.Namespace) -> int:
    from kvstore.server import options_from_args, run_until_signal

    logging.basicConfig(level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s kvstore %(levelname)s %(message)s")
    try:
        options = options_from_args(args)
    except ValueError as err:
        print(f"pdserve kvstore: {err}", file=sys.stderr)
        return 2
    asyncio.run(run_until_signal(args.bind, options))
    return 0
