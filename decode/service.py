"""The DecodeWorker gRPC servicer.

Prepare(hint) starts moving KV that already exists (see pdserve.block_prefetch for the signals).
Decode(request): gather the prompt's blocks (paged cache here, prefetched, or fetched now) and add
the request with them (`AddRequest`); the scheduler shares or copies them into the paged cache when
it admits it (and computes from the first block that is missing or corrupt), the request's blocks
in the KV store are unpinned, then the tokens of the continuous batch stream. A cancelled call
aborts the sequence, which frees its blocks, and ends the request's kvstore lease (`RequestLease`:
once, after a fetch still in flight under it).

Decode with `local_prefill` prefills here instead: the worker hashes the prompt's full blocks,
takes the leading ones it finds (paged cache, kvstore), computes the rest, and the first chunk
carries the first generated token (and, in `cached_tokens`, the prompt tokens reused). The gateway
uses it to resume a stream whose decode worker died (the prompt then ends with the tokens
generated so far), when no prefill worker is healthy, and when its placement policy says so.

Structured output: the sequence's grammar state is rebuilt here, not shipped: the engine builds a
matcher for the request's spec and advances it over the tokens generated before (prefill's first
token, or a resumed stream's `resumed_tokens`), so sampling continues in the same state (the
presence/frequency penalties count the same tokens). Tokens the grammar refuses, or a spec that
does not compile for this model, are INVALID_ARGUMENT.

The kvstore is never required: when it is unreachable the blocks count as missing and the
engine computes them (`KVOutage` logs that once per outage).

Each block the sequence fills is written back to the kvstore, unpinned, in the background
(decode.write_back): a resume on another worker, or the next turn of the conversation, finds the
prompt and the answer so far by prefix lookup on any worker.

Draining (SIGTERM; pdserve.drain): new Decode calls are refused with UNAVAILABLE, running streams
go on until the drain deadline; then each remaining stream waits for its write-backs in flight
and ends with UNAVAILABLE after the last token it sent, and the gateway resumes it on another
decode worker, which finds the prompt and the answer's full blocks in the kvstore.

A background task reports the paged cache's full blocks to the kvstore's residency index (about
once a second, as deltas) so the gateway can route a prompt to the worker that holds its prefix.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import grpc

from pdserve.block_prefetch import BlockPrefetcher, answer_prepare
from decode.write_back import BlockWriteBack, WriteBackQueue
from pdserve.drain import HANDOVER_FLUSH_S, Drain, HandedOver
from pdserve.grpc_server import abort_on
from pdserve.proto_convert import logprobs_to_proto, sampling_from_proto
from pdserve.runtime.engine import AddRequest, StepOutput
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from pdserve.worker_common import WORKER_ERROR_CODES, RequestLease, Worker

SERVICE_NAME = "pdserve.v1.DecodeWorker"
log = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker: Worker, write_back: bool | None = None,
                 residency_interval_s: float | None = None) -> None:
        self.worker = worker
        self.prefetcher = BlockPrefetcher(worker)
        config = worker.config  # WorkerConfig: --kv-write-back, --residency-interval-s (and their env vars)
        self.write_back = config.kv_write_back if write_back is None else write_back
        self.stream_interval = config.stream_interval
        interval = residency_interval_s or config.residency_interval_s
        self._tasks: set[asyncio.Task] = set()
        self.write_queue = WriteBackQueue(worker, self._spawn)  # every request's written-back blocks
        self.drain = Drain(f"decode worker {worker.worker_id}")
        self._reporter = asyncio.get_running_loop().create_task(self._report_residency_forever(interval))

    async def Prepare(self, request: worker_pb2.PrepareRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrepareResponse:
        if self.drain.draining:  # a hint: nothing is worth moving to a worker that is leaving
            return worker_pb2.PrepareResponse()
        return await answer_prepare(self.prefetcher, request, context, "dispatch")

    @abort_on(WORKER_ERROR_CODES)
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        if not rid:
            raise ValueError("request_id is empty: the gateway names every request")
        if request.resumed_tokens < 0 or (prompt and request.resumed_tokens >= len(prompt)):
            raise ValueError(f"resumed_tokens must be in [0, {len(prompt)}) (tokens of the prompt that"
                             f" were generated before), got {request.resumed_tokens}")
        params = sampling_from_proto(request.sampling)
        if request.local_prefill:
            hashes = self.worker.kv_format.reusable_hashes(prompt)
            tokens = prompt
        else:
            hashes = list(request.block_hashes)
            tokens = prompt + [request.first_token]
        with self.drain.call():  # UNAVAILABLE at once while draining: the gateway goes elsewhere
            # The prompt blocks a prefill worker named are in the store: the writer skips them.
            stored = None if request.local_prefill else hashes
            writer = BlockWriteBack(self.write_queue, rid, tokens, stored) if self.write_back else None
            lease = RequestLease(self.worker, rid)  # ended once: when the KV is in our cache, or on leaving
            unsent = UnsentTokens(self.stream_interval, request.local_prefill)
            imported, handed_over = False, False
            try:
                blocks = await self.drain.unless_handed_over(lease.run(self.prefetcher.gather(rid, hashes)))
                if request.local_prefill:
                    add = AddRequest(rid, prompt, params, blocks=blocks, resumed_tokens=request.resumed_tokens)
                else:
                    add = AddRequest(rid, prompt, params, blocks=blocks, first_token=request.first_token,
                                     prompt_hashes=hashes)
                # aclosing: leaving early (client gone, handover) aborts the sequence at once.
                async with aclosing(self.worker.aengine.generate(add)) as stream:
                    while (outs := await self.drain.unless_handed_over(anext(stream, None))) is not None:
                        if not imported:
                            imported = True
                            lease.end(drop=False)  # the KV is in our cache now
                        if writer is not None:
                            writer.extend([t for o in outs for t in o.new_token_ids], last=bool(outs[-1].finish_reason))
                        unsent.extend(outs)
                        if unsent.ready():
                            yield unsent.take()
            except HandedOver:
                handed_over = True
                if unsent.outputs:  # what the gateway has not seen: the worker resuming it goes on after it
                    yield unsent.take()
                if writer is not None:  # so that the worker resuming it finds every full block
                    await writer.flush(HANDOVER_FLUSH_S)
                raise
            finally:
                lease.end(drop=not handed_over)  # a no-op once imported; a handed-over request keeps its blocks

    async def _report_residency_forever(self, interval_s: float) -> None:
        reported: set[bytes] | None = None  # None: the kvstore needs a full report
        while True:
            try:
                current = await self.worker.aengine.resident()
                if reported is not None:
                    self.prefetcher.evicted(reported - current)
                reported = await self._report(current, reported)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - routing hints only; retry next round
                log.debug("residency report failed: %s", exc)
                reported = None
            await asyncio.sleep(interval_s)

    async def _report(self, current: set[bytes], reported: set[bytes] | None) -> set[bytes]:
        kv, wid = self.worker.kv, self.worker.worker_id
        if reported is None:
            await kv.report_residency(wid, current, (), reset=True)
            return current
        added, removed = current - reported, reported - current
        if await kv.report_residency(wid, added, removed, reset=False):  # the store forgot us
            await kv.report_residency(wid, current, (), reset=True)
        return current

    def _spawn(self, coro) -> asyncio.Future:
        # A task of its own: it must run even when this call is being cancelled.
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.WorkerStats:
        return self.worker.stats()


class UnsentTokens:
    """A stream's step outputs not yet sent: sent as one chunk once they hold `interval` tokens
    (`--stream-interval`), and at once when the first token or the end is among them.

    vLLM's and SGLang's `--stream-interval`: fewer, larger messages between decode worker, gateway
    and client, text arriving in bursts of that many tokens. On SmolLM2, 2 cores, 32 streams: 4 was
    +13-26 % tok/s at bench-stack's decode-heavy default workload and no faster at 200-token
    prompts with 128-token answers (a stream's step outputs already pile up into one chunk whenever
    the event loop falls behind a step); default 1, as theirs: every token as it comes."""

    def __init__(self, interval: int, local_prefill: bool) -> None:
        self.interval = interval
        self.local_prefill = local_prefill
        self.outputs: list[StepOutput] = []
        self._sent_any = False

    def extend(self, outs: list[StepOutput]) -> None:
        self.outputs.extend(outs)

    def ready(self) -> bool:
        tokens = sum(len(o.new_token_ids) for o in self.outputs)
        return not self._sent_any or tokens >= self.interval or bool(self.outputs[-1].finish_reason)

    def take(self) -> worker_pb2.DecodeChunk:
        outs, self.outputs, self._sent_any = self.outputs, [], True
        return worker_pb2.DecodeChunk(
            token_ids=[t for o in outs for t in o.new_token_ids],
            logprobs=logprobs_to_proto(lp for o in outs for lp in o.logprobs),
            finish_reason=outs[-1].finish_reason,
            cached_tokens=outs[0].cached_tokens if self.local_prefill else 0)


def add_to_server(worker: Worker, server: grpc.aio.Server) -> DecodeServicer:
    """Serve a DecodeServicer of `worker` on `server`; the servicer (run_worker drains it on SIGTERM)."""
    servicer = DecodeServicer(worker)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    return servicer
