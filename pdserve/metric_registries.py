"""Whose Prometheus metrics are whose: one registry per service, and the one a process serves.

Every pdserve process imports every service's modules (`pdserve.cli` builds all the subcommands'
parsers, so a decode worker imports the gateway's code, and the gateway the workers' metric
modules). With every metric on prometheus_client's default registry, each /metrics then showed
every service's families, the others' at zero. So a metric names its service's registry where it
is declared (`registry=WORKER`), and a process serves only its own service's (`for_service`):

    GATEWAY  the default registry: the gateway's metrics (observe, metrics, slo, admission,
             experiments, the HTTP API) stay where tests and `GET /metrics` already read them
    WORKER   prefill and decode workers: the engine's, KV transfer, prefetch, rejected blocks
    KVSTORE  the kvstore's

WORKER and KVSTORE carry the process, platform and GC collectors the default registry has, so every
/metrics has `process_*` and `python_*`. A metric two services record (`pdserve_prefetch_blocks_total`:
the gateway counts late session predictions, workers the rest) is made with `registry=None` and
`share`d into both; each process then serves the counts it made itself.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

GATEWAY = REGISTRY
WORKER = CollectorRegistry()
KVSTORE = CollectorRegistry()
for _registry in (WORKER, KVSTORE):
    ProcessCollector(registry=_registry)
    PlatformCollector(registry=_registry)
    GCCollector(registry=_registry)

_BY_SERVICE = {"gateway": GATEWAY, "prefill": WORKER, "decode": WORKER, "kvstore": KVSTORE}


def for_service(service: str) -> CollectorRegistry:
    """The registry a process running `service` ("gateway", "prefill", "decode", "kvstore"; the
    short names of `telemetry.service_label`) serves at /metrics; the default one for others."""
    return _BY_SERVICE.get(service, REGISTRY)


def share(collector, *registries: CollectorRegistry):  # -> the collector
    """Register one metric (made with `registry=None`) in each of `registries`."""
    for registry in registries:
        registry.register(collector)
    return collector
