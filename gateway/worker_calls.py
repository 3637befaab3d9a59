"""The gateway's RPCs to prefill and decode workers; protobuf stays inside this module.

Failed calls raise `ServiceError` whose code is what the gateway's client should see and whose
message names the worker, so the flow can re-raise it as is: UNAVAILABLE (the worker is gone or
going away; a call the worker cancelled too), RESOURCE_EXHAUSTED (its queue is full), INVALID_ARGUMENT
(it refused the request), DEADLINE_EXCEEDED (the client's deadline ran out); anything else becomes INTERNAL.

A call is also given up, with UNAVAILABLE, when the health checker finds its worker unreachable
while the gateway waits on it (gateway.workers: `WorkerEndpoint.watch`), and a decode stream
when no message came for `stall_s` (gateway.deadlines): a hung worker's calls end as a dead
worker's do, so the flow retries or resumes them elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from gateway.background import spawn
from gateway.workers import WorkerEndpoint
from pdserve.grpc_server import ServiceError
from pdserve.proto_convert import logprob_from_proto, sampling_to_proto
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 5.0
_PASSED_THROUGH = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What prefill tells the gateway about one request."""

    first_token: int
    first_logprob: TokenLogprob | None
    block_hashes: tuple[bytes, ...]  # every prompt block, the partial tail last
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # non-empty: the first token already ends the request
    worker: str = ""  # the prefill worker's address


@dataclass(frozen=True, slots=True)
class DecodedTokens:
    """One DecodeChunk: tokens after the first one (from the first one with local prefill)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str
    cached_tokens: int = 0  # local prefill: prompt tokens whose KV the decode worker reused


def prefill_stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.PrefillWorkerStub:
    return worker_pb2_grpc.PrefillWorkerStub(channel)


def decode_stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.DecodeWorkerStub:
    return worker_pb2_grpc.DecodeWorkerStub(channel)


def worker_error(ep: WorkerEndpoint, err: grpc.aio.AioRpcError, what: str = "") -> ServiceError:
    """The ServiceError to report for a failed call to `ep` (its circuit breaker learns of the failure).

    CANCELLED becomes UNAVAILABLE: the gateway's own cancel of a call (its client left) raises
    CancelledError in the awaiting task, never an AioRpcError, so a CANCELLED status here is the
    worker's: a worker stopping cancels the calls that reached it after its drain counted them (a
    scale-in races the call's start). The flow then retries or resumes it elsewhere, as for a worker
    that died; passed through, the client would read it as its own cancel."""
    code = err.code()
    if code == grpc.StatusCode.CANCELLED:
        code = grpc.StatusCode.UNAVAILABLE
    ep.record(code)
    code = code if code in _PASSED_THROUGH else grpc.StatusCode.INTERNAL
    where = f"{ep.kind} worker {ep.address}" + (f" {what}" if what else "")
    return ServiceError(code, f"{where}: {err.code().name}: {err.details() or 'no details'}")


async def _watched(ep: WorkerEndpoint, wait: Awaitable[T], stall_s: float | None, what: str) -> T:
    """`await wait` (a step of a call to `ep`), given up with UNAVAILABLE when the health checker
    finds `ep` unreachable meanwhile, or after `stall_s` seconds (None: no bound); being given up
    cancels the wait, and with it the call."""
    try:
        async with asyncio.timeout(stall_s) as timeout:
            with ep.watch(timeout):
                return await wait
    except TimeoutError:
        ep.record(grpc.StatusCode.UNAVAILABLE)  # a hung worker fails calls, for its breaker
        why = (f"failed its health checks ({ep.unreachable})" if ep.unreachable
               else f"sent nothing for {stall_s:g} s (--decode-stall-timeout-s)")
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{ep.kind} worker {ep.address} {what}: {why}") from None


async def prefill(ep: WorkerEndpoint, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                  cached_blocks: int, timeout_s: float | None) -> PrefillResult:
    """Run Prefill on `ep`; cancelling the awaiting task cancels the call."""
    request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt_ids,
                                        sampling=sampling_to_proto(sampling), cached_blocks=cached_blocks)
    call = ep.stub.Prefill(request, timeout=timeout_s)
    try:
        reply = await _watched(ep, call, None, "during prefill")  # a long prompt takes long: no stall bound
    except grpc.aio.AioRpcError as err:
        raise worker_error(ep, err) from None
    finally:
        call.cancel()  # no-op when done; stops the worker's work when we were cancelled
    ep.record(None)
    lp = logprob_from_proto(reply.first_logprob) if reply.HasField("first_logprob") else None
    return PrefillResult(reply.first_token, lp, tuple(reply.block_hashes), reply.prompt_tokens,
                         reply.cached_tokens, reply.finish_reason, ep.address)


def send_prepare(ep: WorkerEndpoint, request_id: str, block_hashes: Sequence[bytes],
                 signal: str = "dispatch") -> asyncio.Task:
    """Fire the Prepare hint (`signal`: dispatch | session | hot); its outcome never matters for
    correctness, so failures are only logged."""
    async def call() -> None:
        try:
            await ep.stub.Prepare(worker_pb2.PrepareRequest(request_id=request_id, block_hashes=block_hashes,
                                                            signal=signal),
                                  timeout=PREPARE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.debug("Prepare hint to %s for %s failed: %s", ep.address, request_id, err.code().name)
    return spawn(call(), name=f"prepare-{request_id}")


async def decode(ep: WorkerEndpoint, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                 timeout_s: float | None, prefilled: PrefillResult | None = None, resumed_tokens: int = 0,
                 stall_s: float | None = None) -> AsyncIterator[DecodedTokens]:
    """Stream the tokens after `prefilled.first_token`, or, with `prefilled` None, prefill on the
    decode worker and stream from the first token (`resumed_tokens`: the prompt's last tokens
    were generated before, by a worker that died). UNAVAILABLE when `ep` is found unreachable or
    sends nothing for `stall_s` seconds. Closing the generator early cancels the call, which
    makes the worker abort the sequence and free its KV."""
    request = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                       sampling=sampling_to_proto(sampling), resumed_tokens=resumed_tokens)
    if prefilled is None:
        request.local_prefill = True
    else:
        request.first_token = prefilled.first_token
        request.block_hashes.extend(prefilled.block_hashes)
    call = ep.stub.Decode(request, timeout=timeout_s)
    recorded = False
    chunks = aiter(call)
    try:
        while (chunk := await _watched(ep, anext(chunks, None), stall_s, "during decode")) is not None:
            if chunk.finish_reason and not recorded:  # recorded now: the caller may close us at this chunk
                ep.record(None)
                recorded = True
            yield DecodedTokens(tuple(chunk.token_ids), tuple(logprob_from_proto(lp) for lp in chunk.logprobs),
                                chunk.finish_reason, chunk.cached_tokens)
        if not recorded:
            ep.record(None)  # the stream ended as the worker meant it to
    except grpc.aio.AioRpcError as err:
        raise worker_error(ep, err, "during decode") from None
    finally:
        call.cancel()
