"""Prometheus metrics: the engine's (batch size, step time, queue time, running/waiting, KV blocks)
recorded by AsyncEngine, the gateway's request metrics, and /metrics over HTTP from start_server
when PDSERVE_METRICS_PORT is set. Values are checked against what the test itself did (known
batch sizes, token counts, injected clocks), as deltas of the process-wide default registry."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from conftest import STORIES_GGUF
from pdserve.runtime.async_engine import AsyncEngine
from pdserve.runtime.engine import AddRequest
from pdserve.runtime.sampling_params import SamplingParams


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def bucket(name: str, le: str) -> float:
    return value(f"{name}_bucket", le=le)


@pytest.fixture(scope="module")
def tiny_model():
    """stories260K's config and weights (a GGUF read: no transformers import, which is slow)."""
    from pdserve.runtime.loader import load_checkpoint

    checkpoint = load_checkpoint(STORIES_GGUF)
    return checkpoint.config, checkpoint.weights


def test_engine_metrics_follow_the_steps(make_engine, tiny_model) -> None:
    config, weights = tiny_model
    engine = make_engine(config, weights, num_blocks=64, max_num_seqs=4)
    steps0, batch_sum0 = value("pdserve_engine_step_seconds_count"), value("pdserve_engine_batch_size_sum")
    queue0 = value("pdserve_engine_queue_seconds_count")
    batch4_0 = bucket("pdserve_engine_batch_size", "4.0") - bucket("pdserve_engine_batch_size", "2.0")
    aengine = AsyncEngine(engine, batch_window_s=0.05).start()  # a window long enough to batch all four
    seen_running: list[float] = []

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        n = 0
        async for outs in aengine.generate(AddRequest(f"m{i}", [3, 4, 5, i + 6], params)):
            n += sum(len(o.new_token_ids) for o in outs)
            seen_running.append(value("pdserve_engine_running_seqs"))
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


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_gateway_request_metrics_from_known_timings() -> None:
    from gateway import observe

    clock = FakeClock()
    before = {n: value(n) for n in ("pdserve_ttft_seconds_sum", "pdserve_tpot_seconds_sum", "pdserve_e2e_seconds_sum",
                                    "pdserve_queue_seconds_sum", "pdserve_output_tokens_total")}
    ok0 = value("pdserve_requests_total", status="OK")
    obs = observe.RequestObserver(None, clock=clock)
    clock.now = 0.004
    obs.dispatched()
    clock.now = 0.030
    obs.chunk(1)  # first token at 30 ms
    for _ in range(4):  # 8 more tokens in 4 chunks, the last at 30 + 4 * 10 ms
        clock.now += 0.010
        obs.chunk(2)
    obs.finish("OK")
    obs.finish("OK")  # recorded once
    assert value("pdserve_requests_total", status="OK") - ok0 == 1
    assert value("pdserve_ttft_seconds_sum") - before["pdserve_ttft_seconds_sum"] == pytest.approx(0.030)
    assert value("pdserve_queue_seconds_sum") - before["pdserve_queue_seconds_sum"] == pytest.approx(0.004)
    assert value("pdserve_e2e_seconds_sum") - before["pdserve_e2e_seconds_sum"] == pytest.approx(0.070)
    # TPOT: 40 ms after the first token for the 8 tokens after it
    assert value("pdserve_tpot_seconds_sum") - before["pdserve_tpot_seconds_sum"] == pytest.approx(0.040 / 8)
    assert value("pdserve_output_tokens_total") - before["pdserve_output_tokens_total"] == 9
    # millisecond resolution: a 30 ms TTFT is in the 30 ms bucket, not the 20 ms one
    assert bucket("pdserve_ttft_seconds", "0.03") - bucket("pdserve_ttft_seconds", "0.02") >= 1


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
            in_flight.append(value("pdserve_requests_in_flight"))
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
    ok0 = value("pdserve_requests_total", status="OK")
    busy0 = value("pdserve_requests_total", status="RESOURCE_EXHAUSTED")
    flight0 = value("pdserve_requests_in_flight")

    async def main() -> None:
        sampling = SamplingParams(max_tokens=2)
        out = [m async for m in servicer._stream(GenerationRequest("r1", sampling, prompt="hi"), Context())]
        assert [m.text for m in out] == ["a", "b"]
        with pytest.raises(ServiceError):
            async for _ in servicer._stream(GenerationRequest("r2", sampling, prompt="busy"), Context()):
                pass
        servicer._slo_task.cancel()
    asyncio.run(main())
    assert value("pdserve_requests_total", status="OK") - ok0 == 1
    assert value("pdserve_requests_total", status="RESOURCE_EXHAUSTED") - busy0 == 1
    assert in_flight == [flight0 + 1, flight0 + 1] and value("pdserve_requests_in_flight") == flight0
    assert slo.state.samples == 1  # the successful request's TTFT reached the SLO monitor
    assert observe.status_of(asyncio.CancelledError()) == "CANCELLED"
    assert observe.status_of(ValueError("x")) == "INVALID_ARGUMENT"


def test_metrics_over_http_when_the_port_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve import grpc_server
    from pdserve.ports import free_port

    port = free_port()
    process = grpc_server.ProcessConfig.from_env({grpc_server.METRICS_PORT_ENV: str(port)})  # as a main builds it
    monkeypatch.setattr(grpc_server, "_metrics_port", None)

    async def main() -> None:
        server, _ = await grpc_server.start_server("127.0.0.1:0", lambda s: None, ["pdserve.v1.Test"],
                                                   process=process)
        try:
            assert grpc_server.start_metrics_http() == port  # once per process
        finally:
            await grpc_server.stop_server(server, 0)
    asyncio.run(main())
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("pdserve_engine_step_seconds_bucket", "pdserve_engine_batch_size_bucket", "pdserve_kv_blocks_free",
                 "pdserve_engine_running_seqs", "pdserve_engine_waiting_seqs"):
        assert name in body, name


def test_busy_metrics_port_does_not_stop_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from pdserve import grpc_server

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        monkeypatch.setattr(grpc_server, "_metrics_port", None)
        assert grpc_server.start_metrics_http(taken.getsockname()[1]) is None
