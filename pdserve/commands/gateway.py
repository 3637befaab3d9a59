"""`pdserve gateway`: the public gRPC entry point in front of the prefill and decode workers."""

from __future__ import annotations

import argparse

NAME = "gateway"
HELP = "run the gateway (routes requests through prefill and decode workers)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.server import add_arguments as add_gateway_arguments

    add_gateway_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from gateway.server import run as run_gateway

    return run_gateway(args)
