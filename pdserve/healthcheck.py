"""Asks a pdserve service whether it is SERVING: `python -m pdserve.healthcheck HOST:PORT`.

Exit status 0 when the grpc.health.v1 check says SERVING, 1 otherwise (down, not serving, no
answer within the timeout); made for container healthchecks. `pdserve up` uses `check`.
It dials TLS like the services do (`pdserve.tls`: the PDSERVE_TLS_* environment, which inside a
service's container is the service's own), so a health check works with TLS and mutual TLS on;
health is open to callers without the internal token.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import tls


def check(address: str, service: str = "", timeout_s: float = 2.0, config: tls.TlsConfig | None = None) -> str:
    """The health status name of `service` at `address` ("SERVING", ...), or "UNREACHABLE: <code>".
    `config` is the TLS to dial with (default: this process's)."""
    with open_channel(address, config or tls.current()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return f"UNREACHABLE: {err.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def is_serving(address: str, service: str = "", timeout_s: float = 2.0,
               config: tls.TlsConfig | None = None) -> bool:
    return check(address, service, timeout_s, config) == "SERVING"


def open_channel(address: str, config: tls.TlsConfig) -> grpc.Channel:
    """A blocking channel to `address`: TLS when `config` dials TLS, plaintext otherwise."""
    if config.dials_tls:
        return grpc.secure_channel(address, config.channel_credentials(), options=config.channel_options())
    return grpc.insecure_channel(address)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="host:port of the service")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout)
    except tls.TlsConfigError as err:
        status = f"cannot dial TLS: {err}"
    if status != "SERVING":
        print(f"{args.address}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
