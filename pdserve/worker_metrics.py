"""Prometheus metrics of the prefill and decode workers (the WORKER registry, pdserve.metric_registries).

`PREFETCH_BLOCKS` is also what the gateway counts its session predictions in: one object, shared
into the gateway's registry and the workers', so each process serves the decisions it made itself
(gateway.metrics re-exports it).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from pdserve.metric_registries import GATEWAY, WORKER, share

# direction: "put" (worker -> kvstore: prefill blocks, decode write-back), "get" (kvstore -> worker)
KV_TRANSFER_BYTES = Counter("pdserve_kv_transfer_bytes_total",
                            "Wire-encoded KV bytes moved between a worker and the kvstore", ["direction"],
                            registry=WORKER)
KV_TRANSFER_SECONDS = Histogram("pdserve_kv_transfer_seconds",
                                "Duration of one batched KV transfer between a worker and the kvstore",
                                ["direction"],
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
                                registry=WORKER)
# signal: dispatch | session | hot; outcome: hit (prefetched and then used), late (the request came
# before the blocks did), wasted (prefetched and never used: evicted, dropped, or the session quit)
PREFETCH_BLOCKS = share(Counter("pdserve_prefetch_blocks_total", "Prefetch decisions, counted in KV blocks",
                                ["signal", "outcome"], registry=None), GATEWAY, WORKER)
# reason: why a worker refused a KV block it fetched (the request then recomputes it): mac (forged,
# altered, re-labelled, or unsigned while this worker holds a PDSERVE_KV_MAC_KEY), checksum (corrupted),
# format (another --kv-dtype), invalid (another model or layout, a bad header, a wrong length)
KV_BLOCK_REJECT_REASONS = ("mac", "checksum", "format", "invalid")
KV_BLOCKS_REJECTED = Counter("pdserve_kv_blocks_rejected_total",
                             "KV blocks a worker fetched and refused (recomputed instead), by reason", ["reason"],
                             registry=WORKER)
for _reason in KV_BLOCK_REJECT_REASONS:
    KV_BLOCKS_REJECTED.labels(reason=_reason)  # every reason shows, at 0, before the first rejection
