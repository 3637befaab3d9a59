"""Prometheus metrics of the gateway (default registry; names fixed by the issue).

Another change serves the default registry at the gateway's `GET /metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter

from pdserve.worker_metrics import PREFETCH_BLOCKS

PREFIX_CACHE_HIT_TOKENS = Counter("pdserve_prefix_cache_hit_tokens",
                                  "Prompt tokens whose KV was reused instead of computed")
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of the requests the gateway served")

__all__ = ["PREFETCH_BLOCKS", "PREFIX_CACHE_HIT_TOKENS", "PROMPT_TOKENS"]
