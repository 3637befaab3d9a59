"""The gateway's resume of a stream whose decode worker dies, against scripted decode workers on
loopback: the exact Decode the replacement gets (prompt + every delivered token, max_tokens less
them, resumed_tokens, local prefill, never the dead worker), every token delivered once, stop
strings across the break, and the bound on resumes. The real-process version, with the engine's
greedy output as reference, is tests/test_stack_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from gateway import server as gateway_server
from gateway.flow import GenerationRequest, ModelInfo, RequestFlow
from gateway.limits import InflightLimit
from gateway.resume import MAX_RESUMES
from gateway.targets import parse_target
from gateway.worker_calls import decode_stub, prefill_stub
from gateway.workers import WorkerPool
from pdserve.grpc_server import ServiceError, start_server, stop_server
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc

PROMPT = "Once upon a time"
STORY = " there was a little girl named Lily. She loved to play outside in the sun with her dog."


class Prefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, first_token: int) -> None:
        self.first_token = first_token

    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(request_id=request.request_id, first_token=self.first_token,
                                          block_hashes=[b"h" * 16], prompt_tokens=len(request.token_ids))

    async def Stats(self, request, context):
        return worker_pb2.WorkerStats(worker_id="prefill")


class ScriptedDecode(worker_pb2_grpc.DecodeWorkerServicer):
    """A decode worker whose model continues `story` after `prompt`: it streams the story from where
    the request starts, and dies (UNAVAILABLE) after `die_after` chunks of a request while the
    shared `deaths` budget lasts (each death spends one)."""

    def __init__(self, prompt: list[int], story: list[int], die_after: int, deaths: list[int]) -> None:
        self.prompt, self.story, self.die_after, self.deaths = prompt, story, die_after, deaths
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
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
            yield worker_pb2.DecodeChunk(token_ids=[token], finish_reason="length" if i == n - 1 else "")


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return gateway_server.load_model_info(None, 16, "float32")


@asynccontextmanager
async def flow_with(model: ModelInfo, workers: int, deaths: int, die_after: int = 3
                    ) -> AsyncIterator[tuple[RequestFlow, list]]:
    """A flow over one prefill worker and `workers` decode workers that die `deaths` times in all."""
    tok = model.tokenizer
    prompt, story = tok.encode(PROMPT), tok.encode(STORY, add_bos=False)
    budget = [deaths]
    decoders = [ScriptedDecode(prompt, story, die_after, budget) for _ in range(workers)]
    servers = [await start_server("127.0.0.1:0", lambda s, d=d: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(d, s),
                                  ["fake"]) for d in decoders]
    servers.append(await start_server("127.0.0.1:0", lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(
        Prefill(story[0]), s), ["fake"]))
    addresses = [f"127.0.0.1:{port}" for _, port in servers]
    pools = [WorkerPool("prefill", [parse_target(addresses[-1])], prefill_stub),
             WorkerPool("decode", [parse_target(a) for a in addresses[:-1]], decode_stub)]
    for pool in pools:
        await pool.start()
    try:
        yield RequestFlow(model, *pools, None, InflightLimit(8)), decoders
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
