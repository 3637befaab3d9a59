"""Worker targets given on the command line, and how they turn into endpoint addresses.

Two forms:
- `host:port` (or `[v6addr]:port`): one endpoint. A hostname is resolved by gRPC itself, which
  connects to one of its addresses; use it for a single worker.
- `dns:///name:port` (gRPC's DNS target syntax, no DNS authority): every IPv4 (A record) address
  the name resolves to is its own endpoint. The gateway resolves it at start and again on each
  health probe, so replicas that come and go behind one name (compose's `deploy.replicas`, a
  Kubernetes headless service) are routed to and health-checked one by one.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

DNS_SCHEME = "dns:"


@dataclass(frozen=True, slots=True)
class Target:
    """One parsed target: connect to `host:port`, or to every A record of `host` when `resolve_all`."""

    host: str
    port: int
    resolve_all: bool = False

    @property
    def address(self) -> str:
        """The gRPC address of the unresolved target."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"dns:///{self.address}" if self.resolve_all else self.address


def parse_target(text: str) -> Target:
    """Parse `host:port`, `[v6]:port`, `dns:///host:port` or `dns:host:port`; ValueError if malformed."""
    text = text.strip()
    resolve_all = text.startswith(DNS_SCHEME)
    rest = text[len(DNS_SCHEME):] if resolve_all else text
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:
            raise ValueError(f"target {text!r}: a DNS authority (server) is not supported; "
                             "write dns:///host:port")
    host, port = _split_host_port(rest, text)
    return Target(host, port, resolve_all)


def _split_host_port(hostport: str, original: str) -> tuple[str, int]:
    if hostport.startswith("["):
        host, sep, port = hostport[1:].partition("]:")
    else:
        host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {original!r}: expected host:port or dns:///host:port")
    return host, int(port)


def parse_target_list(text: str) -> list[Target]:
    """Parse a comma-separated list of targets (the --prefill / --decode flags)."""
    targets = [parse_target(part) for part in text.split(",") if part.strip()]
    if not targets:
        raise ValueError("expected at least one target (host:port or dns:///host:port)")
    return targets


async def resolve(target: Target) -> list[str]:
    """The endpoint addresses of `target`, sorted; OSError (socket.gaierror) when DNS fails."""
    if not target.resolve_all:
        return [target.address]
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, family=socket.AF_INET,
                                   type=socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{target.port}" for info in infos})
