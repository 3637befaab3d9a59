"""The path of one request through the gateway, step by step (`RequestFlow.run`).

    GenerationRequest (service.py made it from the proto: text or chat messages, SamplingParams;
                       the HTTP edge may hand over the prompt's token ids, tokenized once there)
     0. (the edge: service.py / http) the client's request_id held per API key, ALREADY_EXISTS
        when in flight (request_ids); `request_id` here is the gateway's own, unique
     1. tokenize: the prompt's length in characters checked first, then the prompt, or the chat
        rendered by the model's template, off the event loop when long (prompts) -> prompt_ids;
        ids the request carries already (`prompt_ids`) are only checked against the vocabulary
     2. validate: prompt not empty, prompt + max_tokens within the context window, the
                  gateway's request limits (request_limits.RequestLimits: max_tokens, stop
                  strings, messages, prompt tokens; SamplingParams validated its own fields
                  already)                                                      INVALID_ARGUMENT
     3. admit: the gateway's bounded in-flight count (limits.InflightLimit)      RESOURCE_EXHAUSTED
     4. hash the prompt's full blocks (BlockNames.full_block_hashes)            -> hashes
     5. ask the kvstore how many leading blocks it holds and which decode worker holds how many
        in its paged cache (best effort)                         -> cached_blocks hint, residency
     6. pick a decode worker by KV-aware cost (router.pick_decode: load, free KV, resident prefix,
        the session's last worker, or the worker its sibling requests chose: `DecodeAffinity`,
        the n choices of one HTTP request) and send it Prepare(the leading hashes the kvstore holds),
        not awaited: KV that already exists starts moving now (none: no hint, as for a new prompt);
        a hot prefix is also sent to the decode workers lacking it
                                                                                UNAVAILABLE if none
     7. place the prefill (placement.PrefillPlacement, asked once; default AlwaysRemote):
        remote: pick a prefill worker; Prefill -> first token + every block hash; a worker that
        answers UNAVAILABLE is marked down and the call is retried once on another (same request
        id: the worker's single flight makes a retry idempotent)               -> PrefillResult
        local, or no prefill worker left to try: skip it; the decode worker prefills in step 9
     8. emit the first token (output.OutputAssembler: incremental detokenizer, stop strings);
        the request ends here when prefill's finish_reason is set or a stop string appeared
     9. Decode on the decode worker (another one if it went down during prefill), with
        local_prefill when step 7 did not prefill: its first chunk then carries the first token.
        Each chunk of tokens is detokenized and emitted; a stop string closes the stream, which
        cancels the call so the worker aborts the sequence and frees its KV. A decode worker lost
        mid-stream (UNAVAILABLE: it died, its health checks failed, or it sent nothing for
        --decode-stall-timeout-s) is replaced: another one resumes with local prefill of the prompt
        + every token delivered (resume.StreamProgress), at most MAX_RESUMES times; the client sees
        each token once, in order. One worker's loss is one retry of the budget however many
        streams it had (gateway.workers)                           UNAVAILABLE when out of resumes
    10. the last chunk carries the finish reason and the Usage

Every downstream call gets the client's remaining time as its timeout (an HTTP request's is
--http-timeout-s, gateway.deadlines). A client cancel cancels
the task running this generator, which cancels the call in progress. The request's kvstore lease
is ended here in the background when the request ends, however it ends: its decode worker ends it
too (once the KV is in its cache), but a worker killed between its last chunk and that release
would leave the blocks pinned until the store's TTL (120 s), and a request that never reached a
decode worker has no other owner. A release is final and idempotent in the store (kvstore.store).

Requests with a session_id feed `sessions.SessionTracker`; a background task (started with the
first such request) sends each session's blocks to its prefill and decode workers shortly before
its next turn is predicted (PDSERVE_SESSION_PREFETCH=0 turns the prefetch off; the session's
workers are still preferred), PDSERVE_HOT_PREFIX_MIN sets how many
requests within a minute make a prefix hot, 0 = off).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from gateway import observe, worker_calls
from gateway.background import spawn
from gateway.deadlines import Deadlines
from gateway.limits import InflightLimit
from gateway.metrics import PREFIX_CACHE_HIT_TOKENS
from gateway.output import OutputAssembler, OutputChunk
from gateway.placement import AlwaysRemote, Placement, PlacementInputs, PrefillPlacement
from gateway.prompts import check_fits, check_vocab, encode_off_loop, prompt_chars
from gateway.request_limits import RequestLimits
from gateway.sessions import HotPrefixes, SessionTracker
from gateway.resume import StreamProgress
from gateway.worker_calls import DecodedTokens, PrefillResult
from gateway.workers import WorkerEndpoint, WorkerPool
from kvstore.client import KVStoreClient
from pdserve.grpc_server import ServiceError
from pdserve.runtime.block_names import BlockNames
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TimeRemaining = Callable[[], float | None]  # seconds left of the client's deadline, None = none
SESSION_TICK_S = 0.05  # how often the session predictor looks for due prefetches


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the gateway needs of the served model (it never runs it)."""

    tokenizer: Tokenizer
    context_window: int  # max_position_embeddings: prompt + generated tokens must fit
    block_names: BlockNames  # the workers' blocks (fingerprint, --block-size, --kv-dtype): how to name them


@dataclass(eq=False)
class DecodeAffinity:
    """Requests that share a prompt (the n choices of one HTTP request) and should decode on one
    worker, whose paged cache then holds the prompt's blocks once: the first of them to pick a
    decode worker records it here, the others prefer it as a session prefers its last worker."""

    address: str = ""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A Generate (`prompt`) or Chat (`messages`) request, protobuf-free."""

    request_id: str  # the gateway's own, unique: names the request downstream (gateway.request_ids)
    sampling: SamplingParams
    prompt: str = ""
    messages: tuple[Mapping[str, Any], ...] | None = None  # a chat when not None (tool turns carry lists)
    session_id: str = ""
    client_request_id: str = ""  # the client's id, if it sent one: echoed back, never sent downstream
    # The prompt as token ids, when the edge has them (an HTTP prompt it tokenized to check the fit,
    # or token ids the client sent): the flow then does not tokenize `prompt` / `messages` again.
    prompt_ids: tuple[int, ...] | None = None
    affinity: DecodeAffinity | None = None  # shared by sibling requests (n choices): one decode worker
    tools: tuple[Mapping[str, Any], ...] | None = None  # OpenAI tools the chat template renders
    tenant: str = ""  # its API key's digest ("" without keys, gateway.request_ids.tenant_of)

    @property
    def public_id(self) -> str:
        """The id the client sees in responses: its own, else the gateway's."""
        return self.client_request_id or self.request_id

    @property
    def session_key(self) -> str:
        """The session as the gateway tracks it: the client's session_id within its tenant, so that a
        caller with another key who sends the same id neither steers this session's routing and
        prefetch nor learns from them ("" without a session)."""
        if not self.session_id or not self.tenant:
            return self.session_id
        return f"{self.tenant[:32]}/{self.session_id}"


class RequestFlow:
    """Runs requests through the prefill and decode pools; see the module docstring for the path."""

    def __init__(self, model: ModelInfo, prefill: WorkerPool, decode: WorkerPool,
                 kvstore: KVStoreClient | None, limit: InflightLimit,
                 sessions: SessionTracker | None = None, hot: HotPrefixes | None = None,
                 placement: PrefillPlacement | None = None,
                 limits: RequestLimits | None = None, deadlines: Deadlines | None = None,
                 session_prefetch: bool = True, hot_prefix_min: int = 4) -> None:
        """`session_prefetch` and `hot_prefix_min` as GatewayConfig's fields of those names (these
        defaults are theirs; the gateway passes its settings' values, see gateway.server.build_flow)."""
        self.model = model
        self.placement = placement or AlwaysRemote()
        self.limits = limits or RequestLimits()
        self.deadlines = deadlines or Deadlines()
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.kvstore = kvstore
        self.limit = limit
        # The tracker also routes a session back to its last decode worker: it exists with the
        # session prefetch off too, so that turning prefetch off changes nothing else.
        self.session_prefetch = session_prefetch
        self.sessions = sessions or SessionTracker()
        self.hot = hot or (HotPrefixes(min_requests=hot_prefix_min) if hot_prefix_min > 0 else None)
        self._session_task: asyncio.Task | None = None

    async def tokenize(self, request: GenerationRequest) -> list[int]:
        """Steps 1-2: validated prompt ids; ValueError with an actionable message."""
        ids = await self.prompt_ids(request)
        check_fits(ids, request.sampling, self.model.context_window)
        self.limits.check_tokens(ids, request.sampling)
        return ids

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Step 1 and the checks before it, without the fit of max_tokens: the request's own ids
        (checked against the vocabulary), else its prompt or chat tokenized. The length in
        characters is checked first; a long prompt is tokenized off the event loop (gateway.prompts)."""
        self.limits.check_request(request)
        if request.prompt_ids is not None:
            return check_vocab(list(request.prompt_ids), self.model.tokenizer.vocab_size)
        chars = prompt_chars(request.prompt, request.messages, request.tools)
        self.limits.check_chars(chars, self.model.context_window)
        return await encode_off_loop(self.model.tokenizer, request.prompt, request.messages, request.tools)

    async def run(self, request: GenerationRequest, time_remaining: TimeRemaining
                  ) -> AsyncIterator[OutputChunk]:
        """Stream the request's output chunks; the last has finish_reason and usage."""
        prompt_ids = await self.tokenize(request)
        with self.limit.admit(len(prompt_ids)) as admitted:  # SLO-aware when on (gateway.admission)
            async for chunk in self._generate(request, prompt_ids, time_remaining):
                admitted.first_token()  # what admission learns from; only the first call counts
                yield chunk

    async def _generate(self, request: GenerationRequest, prompt_ids: list[int],
                        time_remaining: TimeRemaining) -> AsyncIterator[OutputChunk]:
        rid, sampling = request.request_id, request.sampling
        m = self.model
        hashes = m.block_names.full_block_hashes(prompt_ids)
        cached_blocks, resident = await self._lookup(hashes)
        affinity = request.affinity
        session_home = self._session_arrival(request.session_key) or (affinity.address if affinity else "")
        blocks_needed = m.block_names.blocks_for(len(prompt_ids) + sampling.max_tokens)
        # Before prefill: no point computing KV nobody can decode.
        hinted = self.decode_pool.pick_decode(blocks_needed, resident, session_home)
        if affinity is not None and not affinity.address:
            affinity.address = hinted.address  # the siblings follow this request's prompt blocks
        progress = StreamProgress(prompt_ids, sampling)
        out: OutputAssembler | None = None
        try:
            placement = self._place(len(prompt_ids), cached_blocks, hinted)
            with hinted.track():  # counted from the pick so that concurrent requests spread out
                if cached_blocks:  # the hint moves KV the store holds: a prompt it lacks has none to move yet
                    worker_calls.send_prepare(hinted, rid, hashes[:cached_blocks])
                self._send_hot(hashes, resident)
                result = None
                if placement == "remote":
                    result = await self._prefill(rid, prompt_ids, sampling, cached_blocks, time_remaining,
                                                 self._prefill_home(request.session_key))
            if result is not None:
                out = self._assembler(prompt_ids, sampling, result.prompt_tokens, result.cached_tokens)
                first_lp = (result.first_logprob,) if result.first_logprob else ()
                progress.generated.append(result.first_token)
                yield out.add((result.first_token,), first_lp, result.finish_reason)
                if out.finished:
                    self._session_end(request.session_key, "", prompt_ids, progress.generated, result.worker)
                    return
            decode_ep = hinted if hinted.healthy else self.decode_pool.pick_decode(blocks_needed, resident)
            parts = self._decode(decode_ep, rid, progress, result, blocks_needed, time_remaining)
            async with aclosing(parts):
                async for part in parts:
                    if out is None:  # prefilled by the decode worker: its first chunk says what it reused
                        out = self._assembler(prompt_ids, sampling, len(prompt_ids), part.cached_tokens)
                    progress.generated.extend(part.token_ids)
                    chunk = out.add(part.token_ids, part.logprobs, part.finish_reason)
                    if chunk.finish_reason:
                        self._session_end(request.session_key, progress.worker, prompt_ids, progress.generated,
                                          result.worker if result is not None else "")
                    yield chunk
                    if out.finished:
                        return  # a stop string (closing `parts` cancels the call), or the last chunk
            if out is not None and progress.resume_point() is None:  # every token came, the reason did not
                yield out.add((), (), "length")
                return
            raise ServiceError(grpc.StatusCode.INTERNAL, f"decode worker {progress.worker} ended the stream"
                                                         f" of {rid} without a finish reason")
        finally:
            self._end_lease(rid)  # whatever the decode worker did or could not do (module docstring)

    def _assembler(self, prompt_ids: list[int], sampling: SamplingParams, prompt_tokens: int,
                   cached_tokens: int) -> OutputAssembler:
        PREFIX_CACHE_HIT_TOKENS.inc(cached_tokens)
        return OutputAssembler(self.model.tokenizer, prompt_ids, sampling, prompt_tokens, cached_tokens)

    def _place(self, prompt_tokens: int, cached_blocks: int, decode_ep: WorkerEndpoint) -> Placement:
        """Step 7: prefill on a prefill worker (remote) or on the decode worker (local)."""
        healthy = [ep for ep in self.prefill_pool.endpoints if ep.routable]
        return self.placement.place(PlacementInputs(
            prompt_tokens=prompt_tokens,
            cached_tokens=min(cached_blocks * self.model.block_names.block_size, prompt_tokens),
            prefill_inflight=sum(ep.inflight for ep in healthy), prefill_healthy=len(healthy),
            decode_running=decode_ep.running, decode_inflight=decode_ep.inflight))

    async def _lookup(self, hashes: Sequence[bytes]) -> tuple[int, dict[str, int]]:
        """(leading blocks the kvstore holds, {decode worker id: leading blocks resident there});
        (0, {}) when the store cannot tell: only hints."""
        if not hashes or self.kvstore is None:
            return 0, {}
        try:
            return await self.kvstore.lookup_residency(hashes)
        except grpc.aio.AioRpcError as err:
            log.debug("kvstore lookup failed (%s); prefill gets no cache hint", err.code().name)
            return 0, {}

    # ---- predictive prefetch: sessions and hot prefixes ---------------------------------------

    def _session_arrival(self, session_id: str) -> str:
        if not session_id or self.sessions is None:
            return ""
        if self.session_prefetch and (self._session_task is None or self._session_task.done()):
            self._session_task = spawn(self._prefetch_sessions_forever(), name="session-prefetch")
        return self.sessions.arrival(session_id)

    def _prefill_home(self, session_id: str) -> str:
        return self.sessions.prefill_home(session_id) if session_id and self.sessions is not None else ""

    def _session_end(self, session_id: str, worker: str, prompt_ids: list[int], generated: list[int],
                     prefill_worker: str) -> None:
        if not session_id or self.sessions is None:
            return
        tokens = prompt_ids + generated[:-1]  # the last token has no KV on the worker
        self.sessions.finished(session_id, worker, self.model.block_names.full_block_hashes(tokens), prefill_worker)

    async def _prefetch_sessions_forever(self) -> None:
        while True:
            await asyncio.sleep(SESSION_TICK_S)
            try:
                for plan in self.sessions.due():
                    # A worker that is gone is skipped: the next turn will be routed afresh.
                    for pool, address in ((self.prefill_pool, plan.prefill_worker), (self.decode_pool, plan.worker)):
                        ep = pool.by_address(address) if address else None
                        if ep is not None and ep.healthy:
                            worker_calls.send_prepare(ep, f"session-{plan.session_id}", plan.block_hashes, "session")
            except Exception:  # noqa: BLE001 - the predictor must survive anything
                log.exception("session prefetch failed")

    def _send_hot(self, hashes: Sequence[bytes], resident: Mapping[str, int]) -> None:
        if self.hot is None:
            return
        chain = self.hot.observe(hashes)
        if chain is None:
            return
        by_id = {ep.worker_id: ep for ep in self.decode_pool.endpoints if ep.healthy and ep.worker_id}
        for worker_id in self.hot.targets(chain, list(by_id), resident):
            worker_calls.send_prepare(by_id[worker_id], f"hot-{chain[-1].hex()[:12]}", chain, "hot")

    async def _prefill(self, rid: str, prompt_ids: list[int], sampling: SamplingParams,
                       cached_blocks: int, time_remaining: TimeRemaining, home: str = "") -> PrefillResult | None:
        """Step 7: Prefill (on the session's `home` prefill worker while it is not much busier),
        retried once on another worker when the first is UNAVAILABLE; None when no prefill worker
        is left to try (the decode worker then prefills locally)."""
        failed: list[WorkerEndpoint] = []
        while len(failed) < 2:
            try:
                ep = self.prefill_pool.pick(exclude=failed, home=home, cause=failed[-1] if failed else None)
            except ServiceError as err:
                log.info("%s: no prefill worker to try (%s); prefilling on the decode worker", rid, err)
                return None
            observe.mark_dispatched()  # queue time ends here (a no-op outside a request)
            try:
                start = time.perf_counter()
                with ep.track():
                    result = await worker_calls.prefill(ep, rid, prompt_ids, sampling, cached_blocks,
                                                        _timeout(time_remaining))
                self._observe_prefill(result, time.perf_counter() - start)
                return result
            except ServiceError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.prefill_pool.mark_down(ep, str(err))
                failed.append(ep)
        log.warning("%s: prefill failed on %s; prefilling on the decode worker", rid,
                    ", ".join(ep.address for ep in failed))
        return None

    def _observe_prefill(self, result: PrefillResult, seconds: float) -> None:
        """Report a remote prefill's time to a placement policy that learns from it."""
        observe_prefill = getattr(self.placement, "observe_prefill", None)
        if observe_prefill is not None:
            observe_prefill(result.prompt_tokens - result.cached_tokens, seconds)

    async def _decode(self, ep: WorkerEndpoint, rid: str, progress: StreamProgress,
                      prefilled: PrefillResult | None, blocks_needed: int, time_remaining: TimeRemaining
                      ) -> AsyncIterator[DecodedTokens]:
        """Step 9: the decode worker's chunks (from the first token when `prefilled` is None). A worker
        lost mid-stream (UNAVAILABLE) is replaced by another that resumes where the client is
        (gateway.resume), at most MAX_RESUMES times; closing this generator cancels the call."""
        stall_s = self.deadlines.stall_s
        prompt_ids, sampling, resumed = progress.prompt_ids, progress.sampling, 0
        while True:
            progress.worker = ep.address
            try:
                with ep.track():
                    stream = worker_calls.decode(ep, rid, prompt_ids, sampling, _timeout(time_remaining),
                                                 prefilled, resumed, stall_s)
                    async with aclosing(stream):
                        async for part in stream:
                            yield part
                return
            except ServiceError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self.decode_pool.mark_down(ep, str(err))
                progress.lost.append(ep.address)
                point = progress.resume_point()
                if point is None:
                    return
                ep = self._resume_worker(rid, progress, blocks_needed, ep, err)
                prompt_ids, sampling, resumed, prefilled = point.prompt_ids, point.sampling, point.resumed_tokens, None

    def _resume_worker(self, rid: str, progress: StreamProgress, blocks_needed: int, lost: WorkerEndpoint,
                       err: ServiceError) -> WorkerEndpoint:
        """The decode worker to resume `rid` on after losing `lost`; UNAVAILABLE (naming the
        failure) when none may. A worker lost before is a candidate again once its health checks
        pass (it was restarted): only workers marked down are out."""
        if not progress.may_resume():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{rid} lost {len(progress.lost)} decode workers mid-stream"
                               f" ({', '.join(progress.lost)}); not resuming again: {err}")
        try:
            ep = self.decode_pool.pick_decode(blocks_needed, {}, exclude=[lost], cause=lost)
        except ServiceError as pick_err:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"{err}; cannot resume: {pick_err}") from None
        log.warning("resuming %s on decode worker %s after %d tokens: %s", rid, ep.address,
                    len(progress.generated), err)
        return ep

    def _end_lease(self, rid: str) -> None:
        """Unpin the request's blocks in the kvstore, in the background (they stay cached)."""
        if self.kvstore is None:
            return
        kvstore = self.kvstore

        async def release() -> None:
            try:
                await kvstore.release(rid)
            except grpc.aio.AioRpcError as err:
                log.debug("kvstore release of %s failed: %s", rid, err.code().name)
        spawn(release(), name=f"release-{rid}")


def _timeout(time_remaining: TimeRemaining) -> float | None:
    """The client's remaining time as a call timeout; DEADLINE_EXCEEDED once it has run out."""
    left = time_remaining()
    if left is None or left > 1e7:  # no deadline (some grpc versions report a huge number)
        return None
    if left <= 0:
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
    return left
