"""`pdserve kvstore`: run the KV block store service (memory tier, optional Redis tier)."""

from __future__ import annotations

import argparse

NAME = "kvstore"
HELP = "run the KV store service (content-addressed KV blocks, LRU, leases, optional Redis tier)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvstore.config import add_arguments as add_kvstore_arguments

    add_kvstore_arguments(p)  # one flag per KVStoreConfig setting, shared with `python -m kvstore.server`


def run(args: argparse.Namespace) -> int:
    from kvstore.server import run as run_kvstore

    return run_kvstore(args)
