"""TLS for every pdserve connection: one `TlsConfig` per process, read from the environment once.

Why environment variables and not flags: every process of a stack needs the same settings, and
`pdserve up` (its children inherit its environment), `pdserve.healthcheck` (run inside the
container next to the service) and compose (`environment:`) all pass environment through without
knowing about TLS. The variables (all optional; none set = plaintext, as before):

    PDSERVE_TLS_CERT         PEM certificate (chain) of this process: its server certificate, and
                             its client certificate when it dials a server that asks for one
    PDSERVE_TLS_KEY          PEM private key of that certificate (required with the cert)
    PDSERVE_TLS_CA           PEM CA bundle that verifies the peers' certificates: clients check
                             servers with it (system roots when unset), and under client auth the
                             internal servers check clients with it
    PDSERVE_TLS_CLIENT_AUTH  1: the internal servers (kvstore, prefill, decode) require a client
                             certificate signed by PDSERVE_TLS_CA (mutual TLS). The gateway's
                             public gRPC and HTTP ports never do: clients there use API keys.
    PDSERVE_TLS_SERVER_NAME  the name clients check servers' certificates against instead of the
                             dialled host (a certificate shared by replicas, tests)

A process with a certificate serves TLS on its gRPC port (and the gateway on its HTTP port); a
process with a certificate or a CA dials TLS. A service's main reads them once (`TlsConfig.from_env`,
as part of its `grpc_server.ProcessConfig`) and hands the config to its servers and channels.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.config_flags import build, setting

ENV_PREFIX = "PDSERVE_TLS_"


class TlsConfigError(ValueError):
    """A PDSERVE_TLS_* setting is missing, contradictory or names an unreadable file."""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Where this process's certificate, key and trusted CA live, and whether to demand client certs."""

    # Environment only (flag=None): every process of a stack needs the same (module docstring).
    cert: str = setting("", "PEM certificate chain path; empty: this process serves plaintext",
                        flag=None, env=ENV_PREFIX + "CERT")
    key: str = setting("", "PEM private key path of the certificate", flag=None, env=ENV_PREFIX + "KEY")
    ca: str = setting("", "PEM CA bundle path verifying peers; empty: system roots (clients), no client auth",
                      flag=None, env=ENV_PREFIX + "CA")
    client_auth: bool = setting(False, "internal servers require a client certificate signed by the CA",
                                flag=None, env=ENV_PREFIX + "CLIENT_AUTH")
    server_name: str = setting("", "the name checked on servers' certificates instead of the dialled host",
                               flag=None, env=ENV_PREFIX + "SERVER_NAME")

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsConfigError("PDSERVE_TLS_CERT and PDSERVE_TLS_KEY go together: set both or neither")
        if self.client_auth and not (self.ca and self.cert):
            raise TlsConfigError("PDSERVE_TLS_CLIENT_AUTH=1 needs PDSERVE_TLS_CA (to verify client "
                                 "certificates) and PDSERVE_TLS_CERT/KEY (to present one)")
        for name, path in (("CERT", self.cert), ("KEY", self.key), ("CA", self.ca)):
            if path and not Path(path).is_file():
                raise TlsConfigError(f"{ENV_PREFIX}{name}={path}: no such file")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TlsConfig:
        """The config the PDSERVE_TLS_* variables of `env` describe."""
        return build(cls, None, env)

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def dials_tls(self) -> bool:
        return bool(self.cert or self.ca)

    def server_credentials(self, public: bool = False) -> grpc.ServerCredentials:
        """gRPC server credentials; a `public` server (the gateway) never requires client certificates."""
        require = self.client_auth and not public
        return grpc.ssl_server_credentials([(_read(self.key), _read(self.cert))],
                                           root_certificates=_read(self.ca) if self.ca else None,
                                           require_client_auth=require)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: the CA to trust, and this process's certificate as client certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def http_ssl_context(self) -> ssl.SSLContext:
        """The server-side SSL context of the gateway's HTTP API (no client certificates asked)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context

    def env(self) -> dict[str, str]:
        """The PDSERVE_TLS_* variables that describe this config (to hand to a child process)."""
        values = {"CERT": self.cert, "KEY": self.key, "CA": self.ca,
                  "CLIENT_AUTH": "1" if self.client_auth else "", "SERVER_NAME": self.server_name}
        return {ENV_PREFIX + name: value for name, value in values.items() if value}


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TlsConfigError(f"cannot read TLS file {path}: {err.strerror or err}") from err


def current() -> TlsConfig:
    """The TLS this process's environment describes, read now and kept nowhere: for
    `pdserve.healthcheck`, a command of its own run next to a service (servers and channels are
    handed their config by their main instead)."""
    return TlsConfig.from_env(os.environ)
