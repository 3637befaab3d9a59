"""Circuit breaker state machine and retry budget (pure logic, injected clock), and how a worker
pool routes around an open breaker and refuses retries past the budget."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import grpc
import pytest

from gateway import worker_calls
from gateway.breaker import BreakerConfig, CircuitBreaker, State
from gateway.retry import RetryBudget, RetryBudgetConfig, backoff_s
from gateway.workers import WorkerEndpoint, WorkerPool
from pdserve.grpc_server import ServiceError
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2

FAIL = grpc.StatusCode.UNAVAILABLE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **kw) -> CircuitBreaker:
    config = BreakerConfig(**{"consecutive_failures": 3, "base_cooldown_s": 1.0, "max_cooldown_s": 8.0,
                              "jitter": 0.0, **kw})
    return CircuitBreaker(config, clock, random.Random(0))


def test_opens_after_consecutive_failures_and_a_success_resets_the_count():
    clock = Clock()
    b = breaker(clock)
    b.record(FAIL)
    b.record(FAIL)
    b.record(None)  # the run of failures is broken
    b.record(FAIL)
    b.record(FAIL)
    assert b.state is State.CLOSED and b.available()
    b.record(FAIL)
    assert b.state is State.OPEN and not b.available()
    assert b.seconds_until_trial() == pytest.approx(1.0)


def test_failures_that_say_nothing_about_the_worker_do_not_count():
    b = breaker(Clock())
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED) * 3:
        b.record(code)
    assert b.state is State.CLOSED


def test_opens_on_failure_rate_without_a_run_of_failures():
    b = breaker(Clock(), consecutive_failures=100, window_calls=10, failure_rate=0.5)
    for i in range(9):
        b.record(FAIL if i % 2 == 1 else None)  # 4 of 9, never two in a row
    assert b.state is State.CLOSED
    b.record(FAIL)  # 5 of the last 10 = the rate
    assert b.state is State.OPEN


def test_half_open_lets_exactly_one_trial_through_and_closes_on_its_success():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record(FAIL)
    clock.now += 0.99
    assert not b.available()
    clock.now += 0.02
    assert b.available() and b.state is State.OPEN
    b.acquire()  # the trial
    assert b.state is State.HALF_OPEN and not b.available()  # nobody else meanwhile
    b.record(None)
    assert b.state is State.CLOSED and b.available() and b.opened_count == 0


def test_failed_trials_double_the_cooldown_up_to_the_cap():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record(FAIL)
    cooldowns = []
    for _ in range(5):
        cooldowns.append(b.seconds_until_trial())
        clock.now += b.seconds_until_trial()
        b.acquire()
        b.record(FAIL)
    assert cooldowns == pytest.approx([1.0, 2.0, 4.0, 8.0, 8.0])


def test_cooldown_jitter_stays_in_its_band_and_varies():
    clock = Clock()
    seen = set()
    for seed in range(20):
        b = CircuitBreaker(BreakerConfig(consecutive_failures=1, base_cooldown_s=1.0, jitter=0.2),
                           clock, random.Random(seed))
        b.record(FAIL)
        seen.add(round(b.seconds_until_trial(), 6))
    assert all(0.8 <= s <= 1.2 for s in seen) and len(seen) > 10


def test_a_silent_trial_is_given_up_after_its_timeout():
    clock = Clock()
    b = breaker(clock, trial_timeout_s=5.0)
    for _ in range(3):
        b.record(FAIL)
    clock.now += 1.0
    b.acquire()
    clock.now += 4.9
    assert not b.available()
    clock.now += 0.2
    assert b.available()


def test_a_late_success_while_open_does_not_close_it():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record(FAIL)
    b.record(None)  # a call sent before it opened
    assert b.state is State.OPEN


def test_retry_budget_allows_the_floor_plus_a_ratio_of_requests_over_the_window():
    clock = Clock()
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, min_retries=2, window_s=10.0), clock)
    for _ in range(30):
        budget.record_request()
    allowed = sum(budget.try_retry() for _ in range(10))
    assert allowed == 5  # 2 + 0.1 * 30
    assert budget.denied == 5
    clock.now += 10.5  # the window has passed: requests and retries expired
    assert [budget.try_retry() for _ in range(3)] == [True, True, False]


def test_backoff_is_full_jitter_under_an_exponential_cap():
    rng = random.Random(1)
    for attempt, cap in [(1, 0.05), (2, 0.1), (3, 0.2), (10, 2.0)]:
        values = [backoff_s(attempt, 0.05, 2.0, rng) for _ in range(200)]
        assert 0 <= min(values) and max(values) <= cap
        assert max(values) > 0.8 * cap  # uses the whole range
    with pytest.raises(ValueError):
        backoff_s(0)


def _pool(n: int, clock: Clock, budget: RetryBudget | None = None) -> WorkerPool:
    pool = WorkerPool("prefill", [], lambda channel: None, retry_budget=budget)
    config = BreakerConfig(consecutive_failures=2, base_cooldown_s=1.0, jitter=0.0)
    pool.endpoints = [WorkerEndpoint("prefill", f"w{i}:1", None, None, None, healthy=True,
                                     breaker=CircuitBreaker(config, clock)) for i in range(n)]
    return pool


def test_pool_routes_around_an_open_breaker_and_sends_one_trial_after_the_cooldown():
    clock = Clock()
    pool = _pool(2, clock)
    bad, good = pool.endpoints
    bad.record(FAIL)
    bad.record(FAIL)
    assert pool.routable_count() == 1
    assert {pool.pick() for _ in range(4)} == {good}
    assert "circuit open" in pool.describe()
    clock.now += 1.0
    good.inflight = 5  # make the recovering worker the least loaded
    assert pool.pick() is bad  # the trial
    assert pool.pick() is good  # no second call while the trial runs
    bad.record(None)
    assert pool.pick() is bad and pool.routable_count() == 2


def test_pool_refuses_a_retry_past_the_budget_naming_the_failure():
    clock = Clock()
    pool = _pool(3, clock, RetryBudget(RetryBudgetConfig(ratio=0.0, min_retries=1), clock))
    first = pool.pick()
    pool.mark_down(first, "UNAVAILABLE: connection refused")
    second = pool.pick(exclude=[first])  # the one retry the floor allows
    assert second is not first
    with pytest.raises(ServiceError) as err:
        pool.pick(exclude=[first, second])
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "retry budget is spent" in str(err.value) and "connection refused" in str(err.value)
    assert pool.retry_budget.denied == 1


def test_one_failed_probe_does_not_drop_a_healthy_worker_two_do():
    import asyncio

    from gateway.targets import parse_target

    async def scenario() -> None:
        pool = WorkerPool("prefill", [parse_target("127.0.0.1:1")], lambda channel: None,
                          probe_timeout_s=0.5, unhealthy_after=2)  # nothing listens on port 1
        await pool.refresh()
        ep = pool.endpoints[0]
        assert not ep.healthy  # never seen healthy: down from the first failure
        ep.healthy, ep.failed_probes = True, 0  # as if it had answered before
        await pool.refresh()
        assert ep.healthy and ep.failed_probes == 1
        await pool.refresh()
        assert not ep.healthy and "UNAVAILABLE" in ep.last_error
        await pool.close()
    asyncio.run(scenario())


class _FinishingCall:
    """A Decode call whose second chunk carries the finish reason."""

    def __init__(self) -> None:
        self.chunks = [worker_pb2.DecodeChunk(token_ids=[5]),
                       worker_pb2.DecodeChunk(token_ids=[6], finish_reason="length")]

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for chunk in self.chunks:
            yield chunk

    def cancel(self) -> None:
        pass


def test_a_decode_stream_closed_at_its_finish_chunk_closes_a_half_open_breaker():
    # Found by `pdserve soak`: the flow stops reading at the chunk with the finish reason, which
    # closed the stream before its success was recorded, so a decode worker's breaker never closed
    # again after a restart; when the other decode worker died, every request failed UNAVAILABLE.
    clock = Clock()
    ep = WorkerEndpoint("decode", "d:1", None, SimpleNamespace(Decode=lambda request, timeout: _FinishingCall()),
                        None, healthy=True, breaker=breaker(clock, consecutive_failures=1))
    ep.record(FAIL)
    clock.now += 5
    ep.breaker.acquire()
    assert ep.breaker.state is State.HALF_OPEN

    async def read_to_the_finish() -> None:
        stream = worker_calls.decode(ep, "r", [1, 2], SamplingParams(max_tokens=2, temperature=0), None)
        async for part in stream:
            if part.finish_reason:
                await stream.aclose()  # what the flow does at the last chunk
                return
    asyncio.run(read_to_the_finish())
    assert ep.breaker.state is State.CLOSED
