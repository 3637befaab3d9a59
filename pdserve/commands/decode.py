"""`pdserve decode`: run one decode worker."""

from __future__ import annotations

import argparse

NAME = "decode"
HELP = "run a decode worker (loads KV from the kvstore, batches decoding, streams tokens)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_worker_args
    from pdserve.worker_config import add_arguments as add_worker_config_args

    add_worker_args(p, default_bind="127.0.0.1:50062")
    add_worker_config_args(p)  # the rest of WorkerConfig: --log-level, --metrics-port, ...
    p.set_defaults(worker_role="decode")  # what role-dependent defaults (--dense-copy auto) read


def run(args: argparse.Namespace) -> int:
    from decode.service import SERVICE_NAME, add_to_server
    from pdserve.worker_common import run_worker

    return run_worker(args, SERVICE_NAME, add_to_server)
