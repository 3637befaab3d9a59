"""Worker targets given on the command line, and how they turn into endpoint addresses.

Three forms:
- `host:port` (or `[v6addr]:port`): one endpoint. A hostname is resolved by gRPC itself, which
  connects to one of its addresses; use it for a single worker.
- `dns:///name:port` (gRPC's DNS target syntax, no DNS authority): every IPv4 (A record) address
  the name resolves to is its own endpoint. The gateway resolves it at start and again on each
  health probe, so replicas that come and go behind one name (compose's `deploy.replicas`, a
  Kubernetes headless service) are routed to and health-checked one by one.
- `file:///absolute/path`: a list file of targets of the first two forms, one a line
  (gateway.target_file). The gateway re-reads it whenever it changes (its mtime is polled on each
  health probe), so whoever writes it (`pdserve up`/`pdserve scale`, a config-management agent)
  adds and removes workers without a restart.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

DNS_SCHEME = "dns:"
FILE_SCHEME = "file:"


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


@dataclass(frozen=True, slots=True)
class FileTarget:
    """A watched list file of targets (gateway.target_file)."""

    path: str  # absolute

    def __str__(self) -> str:
        return f"file://{self.path}"


def parse_target(text: str) -> Target | FileTarget:
    """Parse `host:port`, `[v6]:port`, `dns:///host:port`, `dns:host:port` or `file:///path`;
    ValueError if malformed."""
    text = text.strip()
    if text.startswith(FILE_SCHEME):
        return _parse_file_target(text)
    resolve_all = text.startswith(DNS_SCHEME)
    rest = text[len(DNS_SCHEME):] if resolve_all else text
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:
            raise ValueError(f"target {text!r}: a DNS authority (server) is not supported; "
                             "write dns:///host:port")
    host, port = _split_host_port(rest, text)
    return Target(host, port, resolve_all)


def parse_address_target(text: str) -> Target:
    """A target that names workers itself (not a list file): a list file's line."""
    target = parse_target(text)
    if isinstance(target, FileTarget):
        raise ValueError(f"target {text!r}: a list file cannot name another list file")
    return target


def _parse_file_target(text: str) -> FileTarget:
    rest = text[len(FILE_SCHEME):]
    path = rest[2:] if rest.startswith("//") else ""  # file://<authority><path>: only an empty authority
    if not path.startswith("/"):
        raise ValueError(f"target {text!r}: write a list file as file:///absolute/path")
    return FileTarget(path)


def _split_host_port(hostport: str, original: str) -> tuple[str, int]:
    if hostport.startswith("["):
        host, sep, port = hostport[1:].partition("]:")
    else:
        host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target {original!r}: expected host:port or dns:///host:port")
    return host, int(port)


def parse_target_list(text: str) -> list[Target | FileTarget]:
    """Parse a comma-separated list of targets (the --prefill / --decode flags)."""
    targets = [parse_target(part) for part in text.split(",") if part.strip()]
    if not targets:
        raise ValueError("expected at least one target (host:port, dns:///host:port or file:///path)")
    return targets


async def resolve(target: Target) -> list[str]:
    """The endpoint addresses of `target`, sorted; OSError (socket.gaierror) when DNS fails."""
    if not target.resolve_all:
        return [target.address]
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(target.host, target.port, family=socket.AF_INET,
                                   type=socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{target.port}" for info in infos})
