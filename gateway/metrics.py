"""Prometheus metrics of the gateway (default registry; names fixed by the issue).

Another change serves the default registry at the gateway's `GET /metrics`.
"""

from __future__ import annotations

from prometheus_client import Counter

from pdserve.worker_metrics import PREFETCH_BLOCKS

PREFIX_CACHE_HIT_TOKENS = Counter("pdserve_prefix_cache_hit_tokens",
                                  "Prompt tokens whose KV was reused instead of computed")
PROMPT_TOKENS = Counter("pdserve_prompt_tokens", "Prompt tokens of the requests the gateway served")
PREFILL_PLACEMENT = Counter("pdserve_prefill_placement", "Requests by where their prompt was prefilled: "
                            "remote (a prefill worker) or local (the decode worker)", ["placement"])

__all__ = ["PREFETCH_BLOCKS", "PREFILL_PLACEMENT", "PREFIX_CACHE_HIT_TOKENS", "PROMPT_TOKENS"]
