"""Prometheus metrics of the kvstore process (default registry; the names are fixed by the issue).

Defined once here so that every store in the process (tests start several) updates the same
series; serving them over HTTP is left to a later change.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

KVSTORE_BLOCKS = Gauge("pdserve_kvstore_blocks", "KV blocks held by the kvstore, per tier", ["tier"])
KVSTORE_EVICTIONS = Counter("pdserve_kvstore_evictions_total",
                            "KV blocks evicted by the kvstore, per tier (redis: its own maxmemory evictions)",
                            ["tier"])
KVSTORE_BACKEND_ERRORS = Counter("pdserve_kvstore_backend_errors_total",
                                 "Failed operations on the kvstore's Redis tier (down, refused, timeout)")
