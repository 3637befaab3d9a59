"""Prometheus metrics of the gateway's flow (the GATEWAY registry, pdserve.metric_registries: the
default one, which the gateway serves at `GET /metrics`); the request metrics are gateway.observe's.

`PREFETCH_BLOCKS` is the workers' counter, shared into this registry (the gateway counts its late
session predictions in it).
"""

from __future__ import annotations

from prometheus_client import Counter

from pdserve.worker_metrics import PREFETCH_BLOCKS

PREFIX_CACHE_HIT_TOKENS = Counter("pdserve_prefix_cache_hit_tokens",
                                  "Prompt tokens whose KV was reused instead of computed")
PREFILL_PLACEMENT = Counter("pdserve_prefill_placement", "Requests by where their prompt was prefilled: "
                            "remote (a prefill worker) or local (the decode worker)", ["placement"])

__all__ = ["PREFETCH_BLOCKS", "PREFILL_PLACEMENT", "PREFIX_CACHE_HIT_TOKENS"]
