"""What the gateway tells its clients about its insides: nothing about where its workers run.

Errors raised deep in the flow name worker addresses ("10.0.3.7:50052 sent nothing for 30 s",
gRPC's "ipv4:...:50123: connection refused"); a client, who may be anyone with an API key, gets
the message with those addresses replaced, on the HTTP API (gateway.http.errors) and the gRPC
API (gateway.service, through abort_on). The gateway's log keeps the original.
"""

from __future__ import annotations

import re

# host:port, [v6]:port, and gRPC's ipv4:/ipv6:/dns:/// target forms: how worker addresses appear
# in the flow's and grpc's messages.
_ADDRESS = re.compile(r"(?:(?:ipv4|ipv6|dns|unix):(?://[^/\s]*/)?)?"
                      r"(?:\[[0-9A-Fa-f:.%]+\]|\d{1,3}(?:\.\d{1,3}){3}|[A-Za-z0-9-]*[A-Za-z][A-Za-z0-9.-]*)"
                      r":\d{1,5}\b")
ADDRESS_PLACEHOLDER = "<internal>"


def public_message(message: str) -> str:
    """`message` with every network address replaced, for a client's eyes."""
    return _ADDRESS.sub(ADDRESS_PLACEHOLDER, message)
