"""Prometheus metrics of the kvstore process (the KVSTORE registry, pdserve.metric_registries).

Defined once here so that every store in the process (tests start several) updates the same
series; the kvstore's /metrics (grpc_server.start_metrics_http) serves that registry alone.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from pdserve.metric_registries import KVSTORE

KVSTORE_BLOCKS = Gauge("pdserve_kvstore_blocks", "KV blocks held by the kvstore, per tier", ["tier"],
                       registry=KVSTORE)
KVSTORE_EVICTIONS = Counter("pdserve_kvstore_evictions_total",
                            "KV blocks evicted by the kvstore, per tier (redis: its own maxmemory evictions)",
                            ["tier"], registry=KVSTORE)
KVSTORE_BACKEND_ERRORS = Counter("pdserve_kvstore_backend_errors_total",
                                 "Failed operations on the kvstore's Redis tier (down, refused, timeout)",
                                 registry=KVSTORE)
