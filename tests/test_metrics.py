"""Prometheus metrics: the engine's (batch size, step time, queue time, running/waiting, KV blocks and
usage) recorded by AsyncEngine, the gateway's request metrics (by model_name, inter-token latency),
and /metrics over HTTP from start_server when PDSERVE_METRICS_PORT is set, serving only the
service's own registry. Values are checked against what the test itself did (known batch sizes,
token counts, injected clocks), as deltas of the process-wide registries (pdserve.metric_registries).
tests/test_otel_export.py checks the families each process of a real stack serves."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from conftest import STORIES_GGUF
from pdserve.metric_registries import WORKER
from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.sampling_params import SamplingParams


def value(name: str, **labels: str) -> float:
    """A worker sample (the engine's metrics are on the WORKER registry)."""
    return WORKER.get_sample_value(name, labels) or 0.0


def bucket(name: str, le: str) -> float:
    return value(f"{name}_bucket", le=le)


def total(name: str, **labels: str) -> float:
    """A gateway sample summed over the labels not given (model_name, for one)."""
    return sum(s.value for family in REGISTRY.collect() for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def tiny_model():
    """stories260K's config and weights (a GGUF read: no transformers import, which is slow)."""
    from pdserve.runtime.loader import load_checkpoint

    checkpoint = load_checkpoint(STORIES_GGUF)
    return checkpoint.config, checkpoint.weights


def test_engine_metrics_follow_the_steps(make_engine, tiny_model, monkeypatch) -> None:
    from pdserve.runtime import engine_metrics

    config, weights = tiny_model
    engine = make_engine(config, weights, num_blocks=64, max_num_seqs=4)
    steps0, batch_sum0 = value("pdserve_engine_step_seconds_count"), value("pdserve_engine_batch_size_sum")
    queue0 = value("pdserve_engine_queue_seconds_count")
    batch4_0 = bucket("pdserve_engine_batch_size", "4.0") - bucket("pdserve_engine_batch_size", "2.0")
    seen_running: list[float] = []
    seen_usage: list[float] = []
    refresh = engine_metrics.refresh_gauges

    def refresh_and_read(e) -> None:  # the gauges as each step leaves them, read on the engine thread
        refresh(e)                    # (a client may read them only after the engine finished)
        seen_running.append(value("pdserve_engine_running_seqs"))
        seen_usage.append(value("pdserve_kv_cache_usage_ratio"))

    monkeypatch.setattr(engine_metrics, "refresh_gauges", refresh_and_read)
    aengine = AsyncEngine(engine, batch_window_s=0.05).start()  # a window long enough to batch all four

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        n = 0
        async for outs in aengine.generate(AddRequest(f"m{i}", [3, 4, 5, i + 6], params)):
            n += sum(len(o.new_token_ids) for o in outs)
        return n

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(4)))
    try:
        assert asyncio.run(main()) == [6, 6, 6, 6]
    finally:
        aengine.stop()
    steps = value("pdserve_engine_step_seconds_count") - steps0
    assert steps == engine.stats.steps  # one observation per step
    # every token of the 4 requests came from some step: the batch sizes add up to 24 sequence-steps
    assert value("pdserve_engine_batch_size_sum") - batch_sum0 == sum(
        size * count for size, count in engine.stats.batch_size_counts.items()) == 24
    assert bucket("pdserve_engine_batch_size", "4.0") - bucket("pdserve_engine_batch_size", "2.0") - batch4_0 == \
        engine.stats.batch_size_counts.get(4, 0) >= 1
    assert value("pdserve_engine_queue_seconds_count") - queue0 == 4  # one per request, at its first token
    assert max(seen_running) == 4
    # after the loop went idle the gauges show an empty engine with every block free
    assert value("pdserve_engine_running_seqs") == 0 and value("pdserve_engine_waiting_seqs") == 0
    bm = engine.block_manager
    assert value("pdserve_kv_blocks_free") == bm.num_free_blocks == 64
    assert value("pdserve_kv_blocks_used") == 0
    # four sequences of 10 tokens hold one 16-token block each while they run: 4 of 64 blocks at most
    assert 0 < max(seen_usage) <= 4 / 64 and value("pdserve_kv_cache_usage_ratio") == 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gateway_request_metrics_from_known_timings() -> None:
    from gateway import observe
    from gateway.flow import GenerationRequest
    from gateway.output import OutputChunk, Usage

    clock = FakeClock()
    m = {"model_name": "m-timings"}
    names = ("pdserve_ttft_seconds_sum", "pdserve_tpot_seconds_sum", "pdserve_e2e_seconds_sum",
             "pdserve_queue_seconds_sum", "pdserve_output_tokens_total", "pdserve_inter_token_latency_seconds_sum",
             "pdserve_inter_token_latency_seconds_count")
    before = {n: total(n, **m) for n in names}
    ok0 = total("pdserve_requests_total", status="OK", **m)
    obs = observe.RequestObserver(None, clock=clock, request_id="r-1")
    obs.describe("m-timings", GenerationRequest("r-1", SamplingParams(max_tokens=9, temperature=0.5, top_p=0.9),
                                                messages=({"role": "user", "content": "hi"},)))
    clock.now = 0.004
    obs.dispatched()
    clock.now = 0.030
    obs.output(OutputChunk("a", (5,)))  # first token at 30 ms
    for i in range(4):  # 8 more tokens in 4 chunks, the last at 30 + 4 * 10 ms
        clock.now += 0.010
        last = i == 3
        obs.output(OutputChunk("bb", (6, 7), finish_reason="length" if last else "",
                               usage=Usage(4, 9, 0) if last else None))
    obs.finish("OK")
    obs.finish("OK")  # recorded once

    def delta(name: str) -> float:
        return total(name, **m) - before[name]
    assert total("pdserve_requests_total", status="OK", **m) - ok0 == 1
    assert delta("pdserve_ttft_seconds_sum") == pytest.approx(0.030)
    assert delta("pdserve_queue_seconds_sum") == pytest.approx(0.004)
    assert delta("pdserve_e2e_seconds_sum") == pytest.approx(0.070)
    # TPOT: 40 ms after the first token for the 8 tokens after it
    assert delta("pdserve_tpot_seconds_sum") == pytest.approx(0.040 / 8)
    # ITL: every token after the first, each 10 ms / 2 after the one before it
    assert delta("pdserve_inter_token_latency_seconds_count") == 8
    assert delta("pdserve_inter_token_latency_seconds_sum") == pytest.approx(0.040)
    assert delta("pdserve_output_tokens_total") == 9
    # millisecond resolution: a 30 ms TTFT is in the 30 ms bucket, not the 20 ms one
    ttft_bucket = "pdserve_ttft_seconds_bucket"
    assert total(ttft_bucket, le="0.03", **m) - total(ttft_bucket, le="0.02", **m) >= 1
    # what the request span gets (GenAI semantic conventions)
    assert obs.attributes == {"gen_ai.response.id": "r-1", "gen_ai.request.model": "m-timings",
                              "gen_ai.operation.name": "chat", "gen_ai.request.max_tokens": 9,
                              "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9}
    assert (obs.input_tokens, obs.output_tokens, obs.finish_reasons) == (4, 9, ["length"])


def test_gateway_servicer_counts_statuses_and_in_flight() -> None:
    from gateway import observe
    from gateway.flow import GenerationRequest
    from gateway.output import OutputChunk
    from gateway.service import GatewayServicer
    from gateway.slo import SloConfig, SloMonitor
    from pdserve.grpc_server import ServiceError

    in_flight: list[float] = []

    class FakeFlow:
        prefill_pool = type("P", (), {"endpoints": []})()

        async def run(self, request, time_remaining):
            in_flight.append(total("pdserve_requests_in_flight"))
            if request.prompt == "busy":
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
            yield OutputChunk(text="a", token_ids=(5,), logprobs=(), finish_reason="")
            yield OutputChunk(text="b", token_ids=(6,), logprobs=(), finish_reason="length")

    class Context:
        def time_remaining(self):
            return None

        def invocation_metadata(self):
            return ()

    slo = SloMonitor(SloConfig(min_samples=1, eval_interval_s=0.0))
    servicer = GatewayServicer(FakeFlow(), slo)
    ok0 = total("pdserve_requests_total", status="OK")
    busy0 = total("pdserve_requests_total", status="RESOURCE_EXHAUSTED")
    flight0 = total("pdserve_requests_in_flight")

    async def main() -> None:
        sampling = SamplingParams(max_tokens=2)
        out = [m async for m in servicer._stream(GenerationRequest("r1", sampling, prompt="hi"), Context())]
        assert [m.text for m in out] == ["a", "b"]
        with pytest.raises(ServiceError):
            async for _ in servicer._stream(GenerationRequest("r2", sampling, prompt="busy"), Context()):
                pass
        servicer._slo_task.cancel()
    asyncio.run(main())
    assert total("pdserve_requests_total", status="OK") - ok0 == 1
    assert total("pdserve_requests_total", status="RESOURCE_EXHAUSTED") - busy0 == 1
    assert in_flight == [flight0 + 1, flight0 + 1] and total("pdserve_requests_in_flight") == flight0
    assert slo.state.samples == 1  # the successful request's TTFT reached the SLO monitor
    assert observe.status_of(asyncio.CancelledError()) == "CANCELLED"
    assert observe.status_of(ValueError("x")) == "INVALID_ARGUMENT"


def _families(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name for f in text_string_to_metric_families(body)}


@pytest.mark.parametrize(("service", "own", "others"), [
    ("pdserve.v1.DecodeWorker", ("pdserve_engine_step_seconds", "pdserve_engine_batch_size", "pdserve_kv_blocks_free",
                                 "pdserve_engine_running_seqs", "pdserve_kv_cache_usage_ratio",
                                 "pdserve_engine_preemptions", "pdserve_prefix_cache_queries"),
     ("pdserve_requests", "pdserve_ttft_seconds", "pdserve_slo_breach", "pdserve_kvstore_blocks")),
    ("pdserve.v1.KVStore", ("pdserve_kvstore_evictions",),
     ("pdserve_requests", "pdserve_ttft_seconds", "pdserve_engine_step_seconds", "pdserve_kv_transfer_bytes")),
])
def test_metrics_over_http_serve_the_service_alone(monkeypatch: pytest.MonkeyPatch, service: str,
                                                   own: tuple[str, ...], others: tuple[str, ...]) -> None:
    import gateway.observe  # noqa: F401 - the gateway's metrics exist in this process, as in every service's
    import kvstore.metrics  # noqa: F401
    from pdserve import grpc_server
    from pdserve.ports import free_port

    port = free_port()
    process = grpc_server.ProcessConfig.from_env({grpc_server.METRICS_PORT_ENV: str(port)})  # as a main builds it
    assert process.metrics_host == ""  # the service's bind host
    monkeypatch.setattr(grpc_server, "_metrics_port", None)

    async def main() -> None:
        server, _ = await grpc_server.start_server("127.0.0.1:0", lambda s: None, [service], process=process)
        try:
            assert grpc_server.start_metrics_http() == port  # once per process
        finally:
            await grpc_server.stop_server(server, 0)
    asyncio.run(main())
    families = _families(port)  # bound on 127.0.0.1, the gRPC server's host
    assert set(own) <= families and not set(others) & families, families
    assert "process_cpu_seconds" in families  # every service has the process collectors


def test_metrics_host_follows_the_bind_host() -> None:
    from pdserve.grpc_server import bind_host

    assert [bind_host(b) for b in ("0.0.0.0:50051", "[::1]:7", "localhost:0", ":9")] == \
        ["0.0.0.0", "::1", "localhost", "127.0.0.1"]


def test_busy_metrics_port_does_not_stop_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pdserve import grpc_server

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setattr(grpc_server, "_metrics_port", None)
        assert grpc_server.start_metrics_http(taken.getsockname()[1]) is None


def _run(engine, requests: list[AddRequest]) -> None:
    for request in requests:
        engine.add(request)
    while engine.has_unfinished():
        engine.step()


def test_preemptions_and_prefix_cache_lookups_are_counted(make_engine, tiny_model) -> None:
    """Two sequences that outgrow a 3-block cache: the newer is preempted (recomputed later). The same
    prompt again: its leading full blocks come from the prefix cache. Needs the scheduler's and the
    block manager's calls into engine_metrics (count_preemptions, count_prefix_lookup)."""
    config, weights = tiny_model
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # 22 tokens: 2 blocks each
    engine = make_engine(config, weights, num_blocks=3, block_size=16, max_num_seqs=2)
    preempted0 = value("pdserve_engine_preemptions_total")
    _run(engine, [AddRequest("p1", list(range(3, 13)), greedy), AddRequest("p2", list(range(20, 30)), greedy)])
    assert value("pdserve_engine_preemptions_total") - preempted0 >= 1

    engine = make_engine(config, weights, num_blocks=64)
    prompt = list(range(3, 43))  # 40 tokens: two full 16-token blocks and a tail
    start = (value("pdserve_prefix_cache_queries_total"), value("pdserve_prefix_cache_hits_total"))

    def lookups() -> tuple[float, float]:
        return (value("pdserve_prefix_cache_queries_total") - start[0],
                value("pdserve_prefix_cache_hits_total") - start[1])
    _run(engine, [AddRequest("c1", prompt, SamplingParams(max_tokens=2, temperature=0))])
    assert lookups() == (40, 0)
    _run(engine, [AddRequest("c2", prompt, SamplingParams(max_tokens=2, temperature=0))])
    assert lookups() == (80, 32)
