"""Pools of worker endpoints (one pool per kind: prefill, decode), kept healthy by probing.

A pool starts from its targets (see `targets`): each resolved address becomes a
`WorkerEndpoint` with its own channel and stub. A background task probes every endpoint's
`grpc.health.v1` (service "") each `probe_interval_s`; it also re-resolves `dns:///` targets and
re-reads `file:///` list files that changed (gateway.target_file), adding endpoints for new
addresses and retiring the ones gone: a retired endpoint gets no new call, its calls in flight
(streams) run to their end, and its channel is closed once the last one ends. An endpoint is
marked down by `unhealthy_after` (2) failed probes in a row (one
slow probe on a busy machine is no reason to drop a worker; PDSERVE_PROBE_FAILURES) or at once by
`mark_down` (a call saw UNAVAILABLE), and comes back up on the next successful probe. `pick` asks `router` for the
least-loaded healthy endpoint; `pick_decode` for the KV-aware choice, using what each probe also
learns from the worker's Stats (its worker id, running batch and free KV blocks).

Besides health, each endpoint has a circuit breaker (gateway.breaker) fed by the outcomes of the
calls made to it (`WorkerEndpoint.record`, from gateway.worker_calls): an endpoint is *routable*
when it is healthy and its breaker lets a call through; a pick of an endpoint whose breaker is
half-open is its one trial call. Each pool also owns a retry budget (gateway.retry): a pick with
a non-empty `exclude` is a retry of a failed call and is refused (UNAVAILABLE, naming the
failures) when the budget is spent; `retry_allowed()` asks the budget directly.

The budget stops retry storms against workers that fail calls while they are up; it must not
fail the streams of a worker that died. So a retry names its `cause`, the endpoint whose call
failed, and is charged per *incident* of that endpoint (from the moment it is marked down until
a probe finds it healthy again: `WorkerEndpoint.incident`): the first retry of an incident asks
the budget and every later one gets the same answer, so a dead worker's N streams resuming are
one retry, not N. A retry whose cause is known dead (its health checks failed, or its circuit
breaker is open) is not charged at all: no new call reaches such a worker, so the retries it can
cause are bounded by the calls it had in flight. Health checks that fail also give up the calls
in flight to that worker (`WorkerEndpoint.watch`, used by gateway.worker_calls): a hung worker's
streams are resumed elsewhere at once instead of waiting out the hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.breaker import BreakerConfig, CircuitBreaker, State
from gateway.retry import RetryBudget, RetryBudgetConfig
from gateway.router import Candidate, DecodeCandidate, pick_decode, pick_least_loaded
from gateway.target_file import TargetFile
from gateway.targets import FileTarget, Target, resolve
from pdserve.grpc_server import ServiceError, grpc_channel
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

StubFactory = Callable[[grpc.aio.Channel], Any]


@dataclass(eq=False)
class WorkerEndpoint:
    """One worker process as the gateway sees it."""

    kind: str  # "prefill" | "decode"
    address: str  # "host:port"
    channel: grpc.aio.Channel
    stub: Any  # PrefillWorkerStub or DecodeWorkerStub
    health: health_pb2_grpc.HealthStub
    inflight: int = 0
    healthy: bool = False  # unknown until the first probe answers
    last_error: str = "not probed yet"
    failed_probes: int = 0  # in a row
    # From the worker's Stats at the last probe ("" / 0 until one answers).
    worker_id: str = ""
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    incident: int = 0  # times it went from healthy to down (the retry budget charges one retry each)
    unreachable: str = ""  # why its health checks failed ("" while they pass): calls to it are given up
    _watches: set[asyncio.Timeout] = field(default_factory=set, repr=False)  # calls in flight, see `watch`

    @property
    def routable(self) -> bool:
        """Healthy, and its circuit breaker lets a call through."""
        return self.healthy and self.breaker.available()

    def record(self, code: grpc.StatusCode | None) -> None:
        """The outcome of one call to this worker (None = success), for its circuit breaker."""
        before = self.breaker.state
        self.breaker.record(code)
        after = self.breaker.state
        if after is not before:
            log_fn = log.warning if after is State.OPEN else log.info
            log_fn("%s worker %s: %s (last call: %s)", self.kind, self.address, self.breaker.describe(),
                   code.name if code is not None else "OK")

    @contextmanager
    def watch(self, timeout: asyncio.Timeout) -> Iterator[None]:
        """While the block runs, expire `timeout` (an entered asyncio.timeout around an await on a
        call to this worker) as soon as the health checker finds the worker unreachable."""
        self._watches.add(timeout)
        if self.unreachable:
            _expire(timeout)
        try:
            yield
        finally:
            self._watches.discard(timeout)

    def give_up_calls(self) -> int:
        """Expire every watched wait on this worker (each caller sees TimeoutError and moves on);
        how many."""
        waits = list(self._watches)
        for timeout in waits:
            _expire(timeout)
        return len(waits)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count one request in flight on this worker for the duration of the block."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def describe(self) -> str:
        if not self.healthy:
            return f"{self.address} ({self.last_error})"
        return self.address if self.breaker.state is State.CLOSED else f"{self.address} ({self.breaker.describe()})"


def _expire(timeout: asyncio.Timeout) -> None:
    if not timeout.expired():  # rescheduling an expiring timeout raises
        timeout.reschedule(asyncio.get_running_loop().time())


class WorkerPool:
    """The endpoints of one kind of worker, with health probing and least-loaded picking."""

    def __init__(self, kind: str, targets: Sequence[Target | FileTarget], stub_factory: StubFactory,
                 probe_interval_s: float = 1.0, probe_timeout_s: float = 1.0,
                 breaker: BreakerConfig | None = None, retry_budget: RetryBudget | None = None,
                 unhealthy_after: int | None = None) -> None:
        self.kind = kind  # "prefill" | "decode"
        self.targets = list(targets)
        self.stub_factory = stub_factory
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.unhealthy_after = unhealthy_after or int(os.environ.get("PDSERVE_PROBE_FAILURES", "2"))
        self.breaker_config = breaker or BreakerConfig.from_env()
        self.retry_budget = retry_budget or RetryBudget(RetryBudgetConfig.from_env())
        self.endpoints: list[WorkerEndpoint] = []  # what `pick` chooses from, in address order
        self._retiring: list[WorkerEndpoint] = []  # left the DNS answer or list file; closed once idle
        self._resolve_errors: dict[str, str] = {}  # target -> why it did not resolve last time
        self._files = {t.path: TargetFile(t.path, kind) for t in self.targets if isinstance(t, FileTarget)}
        self._cursor = 0  # round-robin position for ties (see router)
        self._charged: dict[str, tuple[int, bool]] = {}  # address -> (incident, retry verdict)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Resolve the targets and probe once (so the first request sees real health), then keep probing."""
        await self.refresh()
        self._task = asyncio.create_task(self._probe_forever(), name=f"probe-{self.kind}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for ep in [*self.endpoints, *self._retiring]:
            await ep.channel.close()
        self.endpoints.clear()
        self._retiring.clear()

    def pick(self, exclude: Collection[WorkerEndpoint] = (), home: str = "",
             cause: WorkerEndpoint | None = None) -> WorkerEndpoint:
        """The least-loaded routable endpoint not in `exclude` (`home`, a session's last worker,
        preferred while not much busier: router.pick_least_loaded); ServiceError UNAVAILABLE if
        none, or if `exclude` is not empty (a retry, after a failed call to `cause`) and the retry
        budget refuses it (see the module docstring)."""
        self._count_attempt(exclude, cause)
        candidates = [Candidate(ep.address, ep.routable and ep not in exclude, ep.inflight)
                      for ep in self.endpoints]
        home_index = next((i for i, ep in enumerate(self.endpoints) if home and ep.address == home), None)
        return self._chosen(pick_least_loaded(candidates, self._cursor, home_index))

    def pick_decode(self, blocks_needed: int, resident: Mapping[str, int], session_address: str = "",
                    exclude: Collection[WorkerEndpoint] = (), cause: WorkerEndpoint | None = None
                    ) -> WorkerEndpoint:
        """The KV-aware choice (router.pick_decode); `resident` maps worker ids to the prompt's
        leading blocks in their paged cache, `session_address` is the session's last worker;
        `exclude` and `cause` as for `pick`."""
        self._count_attempt(exclude, cause)
        candidates = [DecodeCandidate(ep.address, ep.routable and ep not in exclude, ep.inflight, ep.running,
                                      ep.free_blocks, ep.total_blocks, resident.get(ep.worker_id, 0) if ep.worker_id else 0,
                                      ep.address == session_address)
                      for ep in self.endpoints]
        return self._chosen(pick_decode(candidates, blocks_needed, self._cursor))

    def retry_allowed(self) -> bool:
        """May a failed call be retried now? True spends one retry of the budget (gateway.retry)."""
        allowed = self.retry_budget.try_retry()
        if not allowed:
            log.warning("%s pool: retry budget spent (%d refused so far); not retrying", self.kind,
                        self.retry_budget.denied)
        return allowed

    def routable_count(self) -> int:
        """Endpoints a request could be sent to now (healthy, breaker letting calls through)."""
        return sum(ep.routable for ep in self.endpoints)

    def retry_allowed_after(self, cause: WorkerEndpoint | None) -> bool:
        """May a call that failed on `cause` be retried? Free when `cause` is known dead; else one
        verdict of the budget per incident of `cause` (None: one retry of the budget)."""
        if cause is None:
            return self.retry_allowed()
        if cause.unreachable or cause.breaker.state is State.OPEN:
            return True  # nothing new reaches it: its calls in flight bound the retries, no storm
        charged = self._charged.get(cause.address)
        if charged is None or charged[0] != cause.incident:
            charged = (cause.incident, self.retry_allowed())
            self._charged[cause.address] = charged
        return charged[1]

    def _count_attempt(self, exclude: Collection[WorkerEndpoint], cause: WorkerEndpoint | None) -> None:
        if not exclude:
            self.retry_budget.record_request()
        elif not self.retry_allowed_after(cause):
            failed = ", ".join(ep.describe() for ep in exclude)
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.kind} call failed on {failed} and the retry budget is spent "
                               "(too many retries lately); retry later")

    def _chosen(self, index: int | None) -> WorkerEndpoint:
        if index is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"no healthy {self.kind} worker: {self.describe()}")
        self._cursor = index + 1
        ep = self.endpoints[index]
        ep.breaker.acquire()  # the half-open trial, when its cooldown has passed
        return ep

    def by_address(self, address: str) -> WorkerEndpoint | None:
        return next((ep for ep in self.endpoints if ep.address == address), None)

    def mark_down(self, ep: WorkerEndpoint, reason: str) -> None:
        """Take `ep` out of routing until its next successful health probe (a new incident of it
        when it was up)."""
        if ep.healthy or ep.last_error != reason:  # log transitions, not every failed probe
            log.warning("%s worker %s marked down: %s", self.kind, ep.address, reason)
        if ep.healthy:
            ep.incident += 1
        ep.healthy, ep.last_error = False, reason

    def describe(self) -> str:
        """Every endpoint with its state, for error messages."""
        parts = [ep.describe() for ep in self.endpoints]
        parts += [f"{t} ({err})" for t, err in self._resolve_errors.items()]
        return ", ".join(parts) or "no endpoints (" + ", ".join(map(str, self.targets)) + ")"

    async def refresh(self) -> None:
        """Re-resolve the targets, then probe every endpoint concurrently."""
        await self._update_membership()
        await asyncio.gather(*(self._probe(ep) for ep in self.endpoints))
        await self._close_idle_retired()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the prober must survive anything; try again next round
                log.exception("health probing of %s workers failed", self.kind)

    def _current_targets(self) -> list[Target]:
        """The targets with every list file replaced by its lines now (or its last good ones)."""
        found: list[Target] = []
        for target in self.targets:
            if not isinstance(target, FileTarget):
                found.append(target)
                continue
            watched = self._files[target.path]
            found += watched.poll()
            if watched.error:
                self._resolve_errors[str(target)] = watched.error
            else:
                self._resolve_errors.pop(str(target), None)
        named = {str(t) for t in [*self.targets, *found]}  # a target gone from its file takes its error along
        self._resolve_errors = {t: err for t, err in self._resolve_errors.items() if t in named}
        return list(dict.fromkeys(found))

    async def _update_membership(self) -> None:
        addresses: list[str] = []
        for target in self._current_targets():
            try:
                addresses += await resolve(target)
                self._resolve_errors.pop(str(target), None)
            except OSError as err:
                # Keep the endpoints we have: a DNS hiccup should not empty the pool.
                self._resolve_errors[str(target)] = f"DNS resolution failed: {err}"
                addresses += [ep.address for ep in self.endpoints if ep.address not in addresses]
        wanted = list(dict.fromkeys(addresses))
        by_address = {ep.address: ep for ep in self.endpoints}
        for ep in self.endpoints:
            if ep.address not in wanted:
                log.info("%s worker %s left the pool", self.kind, ep.address)
                self._retiring.append(ep)
        self.endpoints = [by_address.get(a) or self._new_endpoint(a) for a in wanted]

    def _new_endpoint(self, address: str) -> WorkerEndpoint:
        channel = grpc_channel(address)
        log.info("%s worker %s joined the pool", self.kind, address)
        return WorkerEndpoint(self.kind, address, channel, self.stub_factory(channel),
                              health_pb2_grpc.HealthStub(channel), breaker=CircuitBreaker(self.breaker_config))

    async def _probe(self, ep: WorkerEndpoint) -> None:
        try:
            reply = await ep.health.Check(health_pb2.HealthCheckRequest(service=""),
                                          timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            self._probe_failed(ep, f"health check: {err.code().name}")
            return
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            # A worker that says it is going away is believed at once.
            self.mark_down(ep, f"health check: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
        else:
            ep.failed_probes = 0
            if not ep.healthy:
                log.info("%s worker %s is healthy", self.kind, ep.address)
                if ep.unreachable:
                    ep.breaker.reset()  # back from the dead: the failures were its death (gateway.breaker)
                ep.healthy, ep.last_error, ep.unreachable = True, "", ""
            await self._poll_stats(ep)

    def _probe_failed(self, ep: WorkerEndpoint, reason: str) -> None:
        ep.failed_probes += 1
        if ep.failed_probes >= self.unhealthy_after:
            self.mark_down(ep, reason)
            self._unreachable(ep, reason)
        elif not ep.healthy:
            self.mark_down(ep, reason)  # down already (a call failed, or never seen up); not yet unreachable
        else:
            log.info("%s worker %s: %s (%d of %d failed probes before it is marked down)", self.kind,
                     ep.address, reason, ep.failed_probes, self.unhealthy_after)

    def _unreachable(self, ep: WorkerEndpoint, reason: str) -> None:
        """`ep` failed `unhealthy_after` probes in a row: dead or hung. Its calls in flight are given
        up now (their streams resume elsewhere), not when, if ever, it answers."""
        ep.unreachable = reason
        given_up = ep.give_up_calls()
        if given_up:
            log.warning("%s worker %s is unreachable: gave up %d calls in flight", self.kind, ep.address, given_up)

    async def _poll_stats(self, ep: WorkerEndpoint) -> None:
        """Load and identity for routing; a worker without Stats (tests' fakes) just lacks them."""
        try:
            stats = await ep.stub.Stats(worker_pb2.StatsRequest(), timeout=self.probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.debug("Stats of %s worker %s failed: %s", self.kind, ep.address, err.code().name)
            return
        ep.worker_id, ep.running = stats.worker_id, stats.num_running
        ep.free_blocks, ep.total_blocks = stats.num_blocks_free, stats.num_blocks_total

    async def _close_idle_retired(self) -> None:
        for ep in [ep for ep in self._retiring if ep.inflight == 0]:
            self._retiring.remove(ep)
            await ep.channel.close()
