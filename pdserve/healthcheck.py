"""Asks a pdserve service whether it is SERVING: `python -m pdserve.healthcheck HOST:PORT`.

Exit status 0 when the grpc.health.v1 check says SERVING, 1 otherwise (down, not serving, no
answer within the timeout); made for container healthchecks. `pdserve up` uses `check`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    """The health status name of `service` at `address` ("SERVING", ...), or "UNREACHABLE: <code>"."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return f"UNREACHABLE: {err.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    return check(address, service, timeout_s) == "SERVING"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    if status != "SERVING":
        print(f"{args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
