"""KVStoreConfig: every setting of the kvstore service, one frozen dataclass built once at start.

`pdserve kvstore` and `python -m kvstore.server` build it in `kvstore.server.run` from the flags
(`add_arguments`, derived from the fields below) and the environment (`KVStoreConfig.from_args`),
and hand it to `kvstore.server.serve_store`, which builds the store and the server from it. An
in-process kvstore (`serve_store(KVStoreConfig(...))`, tests and benchmarks) gets the same
defaults as the command: one default per setting, here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.config_flags import LOG_LEVEL_ENV, FromFlags, add_flags, check_log_level, nested, setting
from pdserve.grpc_server import ProcessConfig

DEFAULT_BIND = "127.0.0.1:50070"  # loopback unless told otherwise: the store trusts its writers
BACKEND_ENV = "PDSERVE_KV_BACKEND"


def parse_backend(backend: str) -> str:
    """The Redis URL of a --kv-backend value, "" for none; ValueError for anything else."""
    if backend in ("", "memory"):
        return ""
    if backend.startswith(("redis://", "rediss://", "unix://")):
        return backend
    raise ValueError(f"--kv-backend ({BACKEND_ENV}) must be 'memory' or redis://host:port/db, got {backend!r}")


@dataclass(frozen=True, slots=True)
class KVStoreConfig(FromFlags):
    """The kvstore's settings: where it listens, the memory tier, leases, the Redis tier; each
    field's text is its flag's --help."""

    bind: str = setting(DEFAULT_BIND, "host:port to serve gRPC on (0.0.0.0:50070 serves every interface)")
    capacity_bytes: int = setting(1 << 30, "memory tier: block data capacity in MiB", flag="--capacity-mb",
                                  scale=1 / (1 << 20), metavar="MIB")
    lease_ttl_s: float = setting(120.0, "a lease not used or released for this long is released", metavar="S")
    # Evicting down to low when a put would go above high makes a burst of puts pay for one sweep.
    high_watermark: float = setting(0.95, "memory tier: start evicting when a put would go above this fraction "
                                    "of capacity")
    low_watermark: float = setting(0.85, "memory tier: evict down to this fraction of capacity")
    backend: str = setting("memory", "second tier: 'memory' (none) or redis://host:port/db", flag="--kv-backend",
                           env=BACKEND_ENV, metavar="BACKEND")
    backend_timeout_s: float = setting(0.5, "a Redis call slower than this (ms) counts as an outage",
                                       flag="--backend-timeout-ms", scale=1e3, metavar="MS")
    log_level: str = setting("INFO", "logging level", env=LOG_LEVEL_ENV, metavar="LEVEL")
    process: ProcessConfig = nested(ProcessConfig, "TLS, internal token, tracing and /metrics")

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"--capacity-mb must be positive, got {self.capacity_bytes / (1 << 20):g}")
        if not self.lease_ttl_s > 0:  # also refuses NaN
            raise ValueError(f"--lease-ttl-s must be positive, got {self.lease_ttl_s:g}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError(f"need 0 < --low-watermark ({self.low_watermark:g}) <= --high-watermark "
                             f"({self.high_watermark:g}) <= 1")
        parse_backend(self.backend)
        if not self.backend_timeout_s > 0:
            raise ValueError(f"--backend-timeout-ms must be positive, got {self.backend_timeout_s * 1e3:g}")
        check_log_level(self.log_level)

    @property
    def redis_url(self) -> str:
        """The Redis tier's URL, "" when there is none."""
        return parse_backend(self.backend)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The kvstore's flags (`pdserve kvstore` and `python -m kvstore.server`), one per setting."""
    add_flags(parser, KVStoreConfig)
