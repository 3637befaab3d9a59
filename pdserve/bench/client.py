"""Sends a workload to the gateway over gRPC and times every streamed chunk.

Conversations start at their arrival offsets (open loop); `max_concurrency` caps the requests in
flight (a closed loop when every conversation starts at once). Turns of a conversation run one after
another: the next turn's prompt is this turn's prompt + the text the gateway streamed back + the
next user text, after the conversation's think time. A failed turn ends its conversation.

Timing per request, from the moment it is sent: TTFT (first chunk with tokens), ITL (the gap
between consecutive token-carrying chunks: a chunk may carry several tokens when the gateway
coalesced them, as vLLM's benchmark counts it), end-to-end latency (last chunk).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.bench.sampling import RequestSampling
from pdserve.bench.workloads import Conversation


@dataclass(slots=True)
class Chunk:
    num_tokens: int
    text: str
    prompt_tokens: int | None = None  # from the last chunk's usage
    completion_tokens: int | None = None  # the server's own total, when it says (overrides the count)


@dataclass(slots=True)
class RequestRecord:
    conversation: str
    turn: int
    start: float  # seconds from the start of the run
    status: str = "OK"  # gRPC status code name
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    text: str = ""  # what was generated (the next turn's prompt is built from it)

    @property
    def ok(self) -> bool:
        return self.status == "OK"


@dataclass(slots=True)
class RunResult:
    label: str
    records: list[RequestRecord]
    duration_s: float
    request_rate: float = float("inf")


class Backend(Protocol):
    def stream(self, prompt: str, max_tokens: int, session_id: str, request_id: str) -> AsyncIterator[Chunk]: ...

    async def close(self) -> None: ...


class GrpcGateway:
    """The gateway's streaming Generate RPC; ignore_eos, so output lengths are exact; greedy unless
    `sampling` says otherwise."""

    def __init__(self, address: str, timeout_s: float = 300.0, sampling: RequestSampling = RequestSampling()) -> None:
        from pdserve.grpc_server import grpc_channel
        from pdserve.v1 import gateway_pb2_grpc

        self.timeout_s = timeout_s
        self.sampling = sampling
        self._channel = grpc_channel(address)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    async def stream(self, prompt: str, max_tokens: int, session_id: str, request_id: str) -> AsyncIterator[Chunk]:
        from pdserve.v1 import common_pb2, gateway_pb2

        request = gateway_pb2.GenerateRequest(
            prompt=prompt, request_id=request_id, session_id=session_id,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               **self.sampling.fields(request_id)))
        async for msg in self._stub.Generate(request, timeout=self.timeout_s):
            usage = msg.usage.prompt_tokens if msg.HasField("usage") else None
            yield Chunk(len(msg.token_ids), msg.text, usage)

    async def close(self) -> None:
        await self._channel.close()


def status_of(exc: BaseException) -> tuple[str, str]:
    """(status name, message) of a failed request."""
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name, exc.details() or ""
    if isinstance(exc, asyncio.TimeoutError):
        return "DEADLINE_EXCEEDED", "client timeout"
    status = getattr(exc, "status", None)  # an HTTP backend's error (pdserve.bench.openai_client)
    if isinstance(status, int):
        return f"HTTP_{status}", str(exc)
    return type(exc).__name__, str(exc)


async def time_request(backend: Backend, prompt: str, max_tokens: int, session_id: str, request_id: str,
                       record: RequestRecord, clock: Callable[[], float] = time.perf_counter) -> RequestRecord:
    """Send one request and fill `record` with its timings (start is set by the caller)."""
    sent = clock()
    last_token_at: float | None = None
    parts: list[str] = []
    try:
        async for chunk in backend.stream(prompt, max_tokens, session_id, request_id):
            now = clock()
            parts.append(chunk.text)
            if chunk.prompt_tokens is not None:
                record.prompt_tokens = chunk.prompt_tokens
            if chunk.num_tokens:
                if last_token_at is None:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last_token_at)
                last_token_at = now
                record.output_tokens += chunk.num_tokens
            if chunk.completion_tokens is not None:
                record.output_tokens = chunk.completion_tokens
        record.latency = clock() - sent
    except Exception as exc:  # noqa: BLE001 - every failure is a result, counted by status
        record.status, record.error = status_of(exc)
    record.text = "".join(parts)
    return record


async def run_workload(backend: Backend, conversations: Sequence[Conversation], offsets: Sequence[float],
                       max_concurrency: int | None = None, label: str = "pdserve",
                       on_record: Callable[[RequestRecord], None] | None = None,
                       request_rate: float = float("inf"), run_id: str = "bench") -> RunResult:
    """Run every conversation from its offset; returns the records in completion order."""
    records: list[RequestRecord] = []
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def conversation(conv: Conversation, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        history = ""
        for k, turn in enumerate(conv.turns):
            prompt = history + turn.text
            session = f"{run_id}-{conv.id}" if conv.session else ""
            if limit is not None:
                await limit.acquire()
            try:
                record = RequestRecord(conv.id, k, time.perf_counter() - t0)
                await time_request(backend, prompt, turn.max_tokens, session, f"{run_id}-{conv.id}-{k}", record)
            finally:
                if limit is not None:
                    limit.release()
            records.append(record)
            if on_record is not None:
                on_record(record)
            if not record.ok:
                return
            history = prompt + record.text
            if k + 1 < len(conv.turns) and conv.think_time_s:
                await asyncio.sleep(conv.think_time_s)

    await asyncio.gather(*(conversation(c, o) for c, o in zip(conversations, offsets)))
    return RunResult(label, records, time.perf_counter() - t0, request_rate)
