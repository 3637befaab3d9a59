"""SLO-aware admission: the TTFT model and the admit/refuse decision (pure logic, injected clock),
then a real stack flooded past its SLO: fast RESOURCE_EXHAUSTED / HTTP 429 with a retry-after hint,
while the requests it admitted complete with the in-process engine's greedy output."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from gateway.admission import AdmissionConfig, SloAdmission, admission_for, nonnegative_fit
from gateway.limits import InflightLimit
from pdserve.grpc_server import ServiceError

SLO_S = 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, workers: int = 1, max_inflight: int = 1000, **kw) -> SloAdmission:
    config = AdmissionConfig(ttft_slo_s=SLO_S, min_samples=4, learning_queue=3, refit_interval_s=0.0, **kw)
    return SloAdmission(InflightLimit(max_inflight), config, lambda: workers, clock)


def serve_fifo(adm: SloAdmission, clock: Clock, n: int, service_s: float, tokens: int = 10) -> None:
    """Admit n requests at once and complete them one after another, `service_s` each (a worker
    that prefills one request at a time): TTFT of the k-th = k * service_s."""
    held = [adm.admit(tokens) for _ in range(n)]
    tickets = [h.__enter__() for h in held]
    for h, t in zip(held, tickets):
        clock.now += service_s
        t.first_token()
        h.__exit__(None, None, None)


def test_nonnegative_fit_recovers_coefficients_and_never_goes_negative():
    rng = np.random.default_rng(0)
    r = rng.uniform(1, 20, 200)
    x = rng.uniform(10, 400, 200)
    features = np.column_stack([np.ones_like(r), r, x])
    c, a, b = nonnegative_fit(features, 0.01 + 0.02 * r + 0.0001 * x)
    assert (c, a, b) == pytest.approx((0.01, 0.02, 0.0001), rel=1e-6)
    coef = nonnegative_fit(features, 0.3 - 0.01 * r)  # a decreasing trend is not a queue
    assert min(coef) >= 0


def test_learning_admits_a_few_per_worker_then_refuses_with_a_short_retry():
    clock = Clock()
    adm = admission(clock, workers=2)
    held = [adm.admit(10) for _ in range(6)]  # 3 per worker
    for h in held:
        h.__enter__()
    with pytest.raises(ServiceError) as err:
        with adm.admit(10):
            pass
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "learning" in str(err.value) and err.value.retry_after_s == 1.0
    assert adm.pending_requests == 6  # the refused one was never counted


def test_a_fifo_worker_is_learned_and_the_queue_is_cut_where_ttft_passes_the_slo():
    clock = Clock()
    adm = admission(clock)
    for _ in range(4):
        serve_fifo(adm, clock, 3, service_s=0.1)  # TTFT 0.1, 0.2, 0.3 at r = 1, 2, 3
    assert adm.predict(adm.features(10)) == pytest.approx(0.1, abs=1e-6)
    held = [adm.admit(10) for _ in range(5)]  # r = 1..5: TTFT 0.1..0.5, all within 0.5 s
    tickets = [h.__enter__() for h in held]
    with pytest.raises(ServiceError) as err:
        with adm.admit(10):  # r = 6: 0.6 s predicted
            pass
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "predicted time to first token 600 ms exceeds the SLO of 500 ms" in str(err.value)
    assert err.value.retry_after_s == pytest.approx(0.1, abs=1e-6)  # one request must drain first
    clock.now += 0.1
    tickets[0].first_token()  # the first request's first token is out...
    with adm.admit(10):  # ...and there is room again
        pass


def test_noisy_ttfts_add_their_upper_residual_quantile_as_a_margin():
    clock = Clock()
    adm = admission(clock, quantile=0.9)
    rng = np.random.default_rng(1)
    for noise in rng.uniform(0.0, 0.1, 200):  # TTFT 0.1 s + uniform noise up to 0.1 s, one at a time
        with adm.admit(10) as ticket:
            clock.now += 0.1 + noise
            ticket.first_token()
    predicted = adm.predict(adm.features(10))
    assert predicted == pytest.approx(0.1 + 0.09, abs=0.01)  # mean 0.15 + (0.9 quantile - mean) 0.04


def test_requests_still_decoding_count_against_a_new_one():
    clock = Clock()
    adm = admission(clock)
    decoding = []  # context managers of requests past their first token, still streaming

    def admit_one(keep_decoding: bool) -> None:
        cm = adm.admit(10)
        ticket = cm.__enter__()
        clock.now += 0.1 + 0.03 * len(decoding)  # TTFT: 0.1 s + 30 ms per request decoding beside it
        ticket.first_token()
        if keep_decoding:
            decoding.append(cm)
        else:
            cm.__exit__(None, None, None)

    for k in [0, 3, 6, 9, 12, 1, 5, 10] * 3:
        while len(decoding) > k:
            decoding.pop().__exit__(None, None, None)
        while len(decoding) < k:
            admit_one(keep_decoding=True)
        admit_one(keep_decoding=False)
    while decoding:
        decoding.pop().__exit__(None, None, None)
    assert adm.predict(adm.features(10)) == pytest.approx(0.1, abs=1e-6)
    while len(decoding) < 14:
        admit_one(keep_decoding=True)  # the last admitted beside 13 decoding: 0.49 s
    with pytest.raises(ServiceError, match="exceeds the SLO"):
        admit_one(keep_decoding=True)  # beside 14: 0.52 s predicted


def test_more_workers_take_proportionally_more_requests():
    clock = Clock()
    adm = admission(clock, workers=1)
    for _ in range(4):
        serve_fifo(adm, clock, 3, service_s=0.1)
    adm._workers = lambda: 2
    held = [adm.admit(10) for _ in range(10)]  # r = 0.5 .. 5 per worker: within the SLO
    for h in held:
        h.__enter__()
    assert adm.pending_requests == 10
    with pytest.raises(ServiceError):
        with adm.admit(10):
            pass


def test_a_request_that_fails_before_its_first_token_is_not_learned_from():
    clock = Clock()
    adm = admission(clock)
    with pytest.raises(RuntimeError):
        with adm.admit(10):
            clock.now += 5.0
            raise RuntimeError("worker failed")
    assert adm.pending_requests == 0 and adm.pending_tokens == 0 and len(adm.model) == 0


def test_the_inflight_cap_still_holds_under_admission():
    adm = admission(Clock(), max_inflight=2)
    held = [adm.admit(1) for _ in range(2)]
    for h in held:
        h.__enter__()
    with pytest.raises(ServiceError, match="--max-inflight"):
        with adm.admit(1):
            pass


def test_admission_is_off_unless_an_slo_is_set():
    import argparse

    from gateway.config import GatewayConfig, add_arguments

    cap = InflightLimit(4)
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def slo_ms(env: dict[str, str], *flags: str) -> float:
        return GatewayConfig.from_args(parser.parse_args(list(flags)), env).admission_ttft_slo_ms
    assert admission_for(cap, lambda: 1, slo_ms({})) is cap
    assert slo_ms({"PDSERVE_ADMISSION_TTFT_SLO_MS": "250"}) == slo_ms({}, "--admission-ttft-slo-ms", "250") == 250
    adm = admission_for(cap, lambda: 1, slo_ms({"PDSERVE_ADMISSION_TTFT_SLO_MS": "250"}))
    assert isinstance(adm, SloAdmission) and adm.config.ttft_slo_s == 0.25 and adm.cap is cap
    with pytest.raises(ValueError, match="PDSERVE_ADMISSION_TTFT_SLO_MS must be a number"):
        slo_ms({"PDSERVE_ADMISSION_TTFT_SLO_MS": "fast"})
    with pytest.raises(ValueError, match="--admission-ttft-slo-ms.*>= 0"):
        slo_ms({}, "--admission-ttft-slo-ms", "-1")


# ---- the worker's bounded queue -----------------------------------------------------------------


def test_worker_engine_refuses_past_its_open_request_bound_at_once():
    import asyncio

    from pdserve.runtime.async_engine import AsyncEngine
    from pdserve.runtime.engine import AddRequest, Engine, QueueFullError
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.worker_common import WORKER_ERROR_CODES

    engine = Engine.from_checkpoint(load_checkpoint(resolve_model_path(None)))
    aengine = AsyncEngine(engine, batch_window_s=0, max_streams=2).start()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def add(rid: str) -> AddRequest:
        return AddRequest(rid, [1, 400, 500], params)

    async def scenario() -> int:
        open_streams = [aengine.generate(add(f"r{i}")) for i in range(2)]
        for stream in open_streams:
            await anext(stream)  # admitted and stepping; the stream stays open until closed
        with pytest.raises(QueueFullError, match="2 requests open"):
            await anext(aengine.generate(add("r2")))
        for stream in open_streams:
            await stream.aclose()
        last = 0
        async for batch in aengine.generate(add("r3")):  # room again
            last = batch[-1].finished
        return last

    try:
        assert asyncio.run(scenario())
    finally:
        aengine.stop()
    assert WORKER_ERROR_CODES[QueueFullError] == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---- a real stack ------------------------------------------------------------------------------

FLOOD = 24


@pytest.fixture(scope="module")
def overloaded_stack():
    """A stack whose admission SLO (1 ms) no request can meet: once it has measured a few, it
    refuses everything; the ones it measured (while learning) must still be correct."""
    from pdserve.ports import free_port
    from pdserve.stack import start_stack

    stack = start_stack(1, 1, "--http-port", str(free_port()), env={"PDSERVE_ADMISSION_TTFT_SLO_MS": "1"})
    yield stack
    stack.stop()


def test_flood_gets_fast_refusals_with_retry_after_and_admitted_requests_are_correct(overloaded_stack):
    import asyncio

    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import load_checkpoint, resolve_model_path
    from pdserve.runtime.sampling_params import SamplingParams
    from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    checkpoint = load_checkpoint(resolve_model_path(None))
    engine = Engine.from_checkpoint(checkpoint)
    prompt = "Once upon a time"
    engine.add_request("ref", checkpoint.tokenizer.encode(prompt), SamplingParams(max_tokens=12, temperature=0))
    expected: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            expected += out.new_token_ids

    async def one(stub) -> tuple[grpc.StatusCode, list[int], dict[str, str], str]:
        request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=12, temperature=0))
        call = stub.Generate(request, timeout=60)
        tokens: list[int] = []
        try:
            async for chunk in call:
                tokens += chunk.token_ids
        except grpc.aio.AioRpcError:
            pass
        trailers = {k: v for k, v in (await call.trailing_metadata() or ())}
        return await call.code(), tokens, trailers, await call.details() or ""

    async def run() -> list[tuple]:
        async with grpc.aio.insecure_channel(overloaded_stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            learned = [await one(stub) for _ in range(8)]  # one at a time: the learning phase admits these
            flood = await asyncio.gather(*(one(stub) for _ in range(FLOOD)))
            return learned + list(flood)

    results = asyncio.run(run())
    admitted = [r for r in results if r[0] == grpc.StatusCode.OK]
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(admitted) + len(refused) == len(results), [r[0] for r in results]
    assert len(admitted) >= 8 and all(tokens == expected for _, tokens, _, _ in admitted)
    assert len(refused) >= FLOOD  # after learning, a 1 ms SLO admits nothing
    for _, tokens, trailers, details in refused:
        assert not tokens and "exceeds the SLO of 1 ms" in details
        assert int(trailers["retry-after"]) >= 1 and int(trailers["grpc-retry-pushback-ms"]) >= 0

    body = json.dumps({"model": "stories260K", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(overloaded_stack.http_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 429 and int(err.value.headers["Retry-After"]) >= 1
    assert "exceeds the SLO" in json.loads(err.value.read())["error"]["message"]
