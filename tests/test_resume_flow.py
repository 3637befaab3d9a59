"""The gateway's resume of a stream whose decode worker dies, against scripted decode workers on
loopback: the exact Decode the replacement gets (prompt + every delivered token, max_tokens less
them, resumed_tokens, local prefill, never the dead worker), every token delivered once, stop
strings across the break, the bound on resumes, a silent worker given up after the stall timeout,
one retry of the budget per dead worker however many streams it had, and the HTTP request
deadline. The real-process versions, with the engine's greedy output as reference, are
tests/test_stack_faults.py and tests/test_decode_death.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from gateway import server as gateway_server
from gateway.deadlines import Deadlines
from gateway.flow import GenerationRequest, ModelInfo, RequestFlow
from gateway.limits import InflightLimit
from gateway.resume import MAX_RESUMES
from gateway.retry import RetryBudget, RetryBudgetConfig
from gateway.targets import parse_target
from gateway.worker_calls import decode_stub, prefill_stub
from gateway.workers import WorkerEndpoint, WorkerPool
from kvstore.client import KVStoreClient
from kvstore.server import serve as serve_kvstore
from pdserve.grpc_server import ServiceError, start_server, stop_server
from pdserve.kvwire import encode_block
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc

PROMPT = "Once upon a time"
KV_SPEC = KVFormat("ab" * 16, torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
STORY = " there was a little girl named Lily. She loved to play outside in the sun with her dog."


class Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    """Answers every prompt with `first_token`; with a kvstore, first puts one block there under the
    request's lease, as a prefill worker leaves the prompt's KV for the decode worker (pinned), and
    appends the store's count of live leases after the put to `leases_after_put`."""

    def __init__(self, first_token: int, kvstore: KVStoreClient | None = None,
                 leases_after_put: list[int] | None = None) -> None:
        self.first_token, self.kvstore = first_token, kvstore
        self.leases_after_put = leases_after_put if leases_after_put is not None else []

    async def Prefill(self, request, context):
        if self.kvstore is not None:
            block = encode_block(torch.zeros(KV_SPEC.shape), KV_SPEC, KV_SPEC.block_size)
            await self.kvstore.put_blocks(request.request_id, [(b"h" * 16, block)])
            self.leases_after_put.append((await self.kvstore.stats()).num_leases)
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token=self.first_token,
                                          block_hashes=[b"h" * 16], prompt_tokens=len(request.token_ids))

    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="prefill")


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker whose model continues `story` after `prompt`: it streams the story from where
    the request starts, and dies (`death_code`, UNAVAILABLE unless told) after `die_after` chunks of a
    request while the shared `deaths` budget lasts (each death spends one); then falls silent, without
    dying, while the shared `hangs` budget lasts."""

    def __init__(self, prompt: list[int], story: list[int], die_after: int, deaths: list[int],
                 hangs: list[int], death_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.prompt, self.story, self.die_after, self.deaths, self.hangs = prompt, story, die_after, deaths, hangs
        self.death_code = death_code
        self.requests: list[worker_pb2.DecodeRequest] = []

    async def Prepare(self, request, context):
        return worker_pb2.PrepareResponse()

    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id=f"decode-{id(self)}", num_blocks_total=100, num_blocks_free=100)

    async def Decode(self, request, context):
        self.requests.append(request)
        local = request.local_prefill
        start = len(request.prompt_token_ids) - len(self.prompt) + (0 if local else 1)
        n = request.sampling.max_tokens - (0 if local else 1)
        for i, token in enumerate(self.story[start:start + n]):
            if i == self.die_after and self.deaths[0] > 0:
                self.deaths[0] -= 1
                await context.abort(self.death_code, "worker going away")
            if i == self.die_after and self.hangs[0] > 0:
                self.hangs[0] -= 1
                await asyncio.Event().wait()  # until the gateway cancels the call
            yield worker_pb2.DecodeChunk(token_ids=[token], finish_reason="length" if i == n - 1 else "")


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return gateway_server.load_model_info(None, 16, "float32")


@asynccontextmanager
async def flow_with(model: ModelInfo, workers: int, deaths: int, die_after: int = 3, hangs: int = 0,
                    limits: Deadlines | None = None, kvstore: KVStoreClient | None = None,
                    leases_after_put: list[int] | None = None, death_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
                    ) -> AsyncIterator[tuple[RequestFlow, list]]:
    """A flow over one prefill worker and `workers` decode workers that die `deaths` times and
    fall silent `hangs` times in all (none of them ever releases a kvstore lease)."""
    tok = model.tokenizer
    prompt, story = tok.encode(PROMPT), tok.encode(STORY, add_bos=False)
    budget, silences = [deaths], [hangs]
    decoders = [ScriptedDecode(prompt, story, die_after, budget, silences, death_code) for _ in range(workers)]
    servers = [await start_server("127.0.0.1:0", lambda s, d=d: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(d, s),
                                  ["fake"]) for d in decoders]
    servers.append(await start_server("127.0.0.1:0", lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
        Prefill(story[0], kvstore, leases_after_put), s), ["fake"]))
    addresses = [f"127.0.0.1:{port}" for _, port in servers]
    # Probed at start only: a worker marked down by a failed call stays down for the whole test.
    pools = [WorkerPool("prefill", [parse_target(addresses[-1])], prefill_stub, probe_interval_s=600),
             WorkerPool("decode", [parse_target(a) for a in addresses[:-1]], decode_stub, probe_interval_s=600)]
    for pool in pools:
        await pool.start()
    try:
        yield RequestFlow(model, *pools, kvstore, InflightLimit(8), deadlines=limits), decoders
    finally:
        for pool in pools:
            await pool.close()
        for server, _ in servers:
            await stop_server(server, 0)


async def _run(flow: RequestFlow, **sampling) -> list:
    request = GenerationRequest("r1", SamplingParams(temperature=0, **sampling), prompt=PROMPT)
    return [chunk async for chunk in flow.run(request, lambda: None)]


def test_resume_sends_the_next_token_the_client_lacks(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with flow_with(model, 2, deaths=1) as (flow, decoders):  # the first picked dies after 3 chunks
            chunks = await _run(flow, max_tokens=12)
        tok = model.tokenizer
        prompt, story = tok.encode(PROMPT), tok.encode(STORY, add_bos=False)
        assert [t for c in chunks for t in c.token_ids] == story[:12]  # each token once, in order
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
        dead, alive = sorted(decoders, key=lambda d: not d.requests or d.requests[0].local_prefill)
        [resumed] = alive.requests
        assert not dead.requests[0].local_prefill and len(dead.requests) == 1
        delivered = story[:4]  # prefill's first token + 3 decode chunks
        assert resumed.local_prefill and list(resumed.prompt_token_ids) == prompt + delivered
        assert resumed.resumed_tokens == 4 and resumed.sampling.max_tokens == 12 - 4
        assert resumed.request_id == "r1"
    asyncio.run(scenario())


def test_a_stream_its_worker_cancelled_is_resumed_elsewhere(model: ModelInfo) -> None:
    """A stopping decode worker cancels the calls that reached it after its drain counted them (CI saw it:
    `pdserve scale` taking a worker out while a Decode was on its way there, tests/test_scale.py). That
    CANCELLED is the worker's, not the client's (a cancel of ours raises CancelledError, never a status):
    the stream resumes on another worker, each token once, as after a death."""
    async def scenario() -> None:
        async with flow_with(model, 2, deaths=1, die_after=0, death_code=grpc.StatusCode.CANCELLED) as (flow,
                                                                                                      decoders):
            chunks = await _run(flow, max_tokens=12)
        story = model.tokenizer.encode(STORY, add_bos=False)
        assert [t for c in chunks for t in c.token_ids] == story[:12]
        assert chunks[-1].finish_reason == "length"
        assert sorted(len(d.requests) for d in decoders) == [1, 1]  # the cancelled call, then its resume
    asyncio.run(scenario())


def test_stop_string_across_the_break(model: ModelInfo) -> None:
    """The assembler carries over: a stop string half delivered before the death still stops the
    resumed stream, with the same text as an undisturbed run."""
    tok = model.tokenizer
    story = tok.encode(STORY, add_bos=False)
    stop = tok.decode(story[2:5]).strip()  # tokens 2..4; tokens 0..2 are delivered before the break

    async def scenario() -> tuple[list, list]:
        async with flow_with(model, 1, deaths=0) as (flow, _):
            undisturbed = await _run(flow, max_tokens=20, stop=(stop,))
        async with flow_with(model, 2, deaths=1, die_after=2) as (flow, _):
            resumed = await _run(flow, max_tokens=20, stop=(stop,))
        return undisturbed, resumed
    undisturbed, resumed = asyncio.run(scenario())
    assert undisturbed[-1].finish_reason == "stop"
    assert "".join(c.text for c in resumed) == "".join(c.text for c in undisturbed)
    assert [c.finish_reason for c in resumed][-1] == "stop"


def test_resumes_are_bounded(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with flow_with(model, MAX_RESUMES + 2, deaths=MAX_RESUMES + 2, die_after=1) as (flow, decoders):
            with pytest.raises(ServiceError) as err:
                await _run(flow, max_tokens=12)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"lost {MAX_RESUMES + 1} decode workers" in str(err.value)
        assert sorted(len(d.requests) for d in decoders) == [0] + [1] * (MAX_RESUMES + 1)  # none twice
    asyncio.run(scenario())


def test_a_silent_decode_worker_is_given_up_after_the_stall_timeout(model: ModelInfo) -> None:
    """Issue 15 item 7: a worker that stops sending without dying (its health checks pass) held
    its streams until the client's deadline; after --decode-stall-timeout-s they resume elsewhere."""
    async def scenario() -> None:
        async with flow_with(model, 2, deaths=0, hangs=1, limits=Deadlines(decode_stall_s=1.0)) as (flow, decoders):
            chunks = await asyncio.wait_for(_run(flow, max_tokens=12), 30)  # without the bound: a hang
        story = model.tokenizer.encode(STORY, add_bos=False)
        assert [t for c in chunks for t in c.token_ids] == story[:12]
        [resumed] = [r for d in decoders for r in d.requests if r.local_prefill]
        assert resumed.resumed_tokens == 4  # prefill's token + 3 chunks, then the silence
    asyncio.run(scenario())


def _decode_pool(workers: int, budget: RetryBudget) -> WorkerPool:
    pool = WorkerPool("decode", [], decode_stub, retry_budget=budget)
    pool.endpoints = [WorkerEndpoint("decode", f"w{i}:1", None, None, None, healthy=True, free_blocks=100,
                                     total_blocks=100) for i in range(workers)]
    return pool


def test_one_dead_worker_is_one_retry_however_many_streams_it_had() -> None:
    """Issue 15 item 3: each of a dead worker's streams spent a retry, and a third of them failed
    "the retry budget is spent"."""
    pool = _decode_pool(3, RetryBudget(RetryBudgetConfig(ratio=0.0, min_retries=1)))
    dead, *alive = pool.endpoints
    pool.mark_down(dead, "UNAVAILABLE: Socket closed")
    for _ in range(32):  # its 32 streams resume: one incident, one retry
        assert pool.pick_decode(1, {}, exclude=[dead], cause=dead) in alive
    assert pool.retry_budget.denied == 0
    # A flaky worker: up again, failed again, is a new incident, which asks the budget again.
    dead.healthy = True
    pool.mark_down(dead, "UNAVAILABLE: worker going away")
    with pytest.raises(ServiceError, match="retry budget is spent"):
        pool.pick_decode(1, {}, exclude=[dead], cause=dead)
    # Known dead (its health checks failed): nothing new reaches it, its streams are not charged.
    dead.unreachable = "health check: UNAVAILABLE"
    assert pool.pick_decode(1, {}, exclude=[dead], cause=dead) in alive


def test_an_http_request_has_a_deadline(model: ModelInfo) -> None:
    """Issue 15 item 7: HTTP requests had no deadline, so a permanent hang never ended. Here the
    decode worker falls silent with the stall timeout off: --http-timeout-s ends the request."""
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.http.app import create_app

    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}

    async def post(flow: RequestFlow, stream: bool) -> tuple[int, bytes]:
        app = create_app(flow, "stories", deadlines=Deadlines(http_request_s=1.0))
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={**body, "stream": stream})
            return resp.status, await resp.read()

    async def scenario() -> None:
        async with flow_with(model, 1, deaths=0, hangs=2, limits=Deadlines(decode_stall_s=0)) as (flow, _):
            status, whole = await asyncio.wait_for(post(flow, False), 30)  # without the deadline: a hang
            assert status == 504 and "--http-timeout-s" in json.loads(whole)["error"]["message"]
            status, streamed = await asyncio.wait_for(post(flow, True), 30)
        assert status == 200 and b"[DONE]" not in streamed  # the first token came: the error is an event
        last = json.loads(streamed.split(b"\n\n")[-2].removeprefix(b"data: "))
        assert last["error"]["type"] == "timeout"
    asyncio.run(scenario())


@pytest.mark.parametrize("ending", ["length", "stop", "unavailable"])
def test_the_gateway_ends_the_lease_its_decode_worker_never_released(model: ModelInfo, ending: str) -> None:
    """A decode worker killed between its last chunk and its release of the request's kvstore lease
    (the soak's kill fired as a request ended) left the prompt's blocks pinned until the store's
    TTL, 120 s. These decode workers never release: the gateway does, however the request ends (a
    finished stream, a stop string closing it early, its worker lost without a resume)."""
    tok = model.tokenizer
    stop = tok.decode(tok.encode(STORY, add_bos=False)[2:5]).strip()

    async def scenario() -> object:
        server, port = await serve_kvstore("127.0.0.1:0", 1 << 20)
        kv = KVStoreClient(f"127.0.0.1:{port}", timeout_s=30)
        try:
            async with flow_with(model, 1, deaths=int(ending == "unavailable"), kvstore=kv,
                                 leases_after_put=leases_after_put) as (flow, _):
                try:
                    chunks = await _run(flow, max_tokens=12, stop=(stop,) if ending == "stop" else ())
                    assert chunks[-1].finish_reason == ending
                except ServiceError as err:
                    assert ending == "unavailable" and err.code == grpc.StatusCode.UNAVAILABLE
                deadline = asyncio.get_running_loop().time() + 10
                while (stats := await kv.stats()).num_leases and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.02)
            return stats
        finally:
            await kv.close()
            await server.stop(None)
    leases_after_put: list[int] = []
    stats = asyncio.run(scenario())
    assert leases_after_put == [1]  # the prompt's block was pinned under the request's lease
    assert (stats.num_leases, stats.num_pinned, stats.num_blocks) == (0, 0, 1)  # released, still cached
