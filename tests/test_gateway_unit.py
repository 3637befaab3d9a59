"""Gateway: routing policy, target parsing, request conversion and validation, and the request
flow against fake in-process prefill/decode workers on loopback (no child processes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import torch

from gateway import server as gateway_server
from gateway.flow import ModelInfo, RequestFlow
from gateway.limits import InflightLimit
from gateway.output import OutputAssembler
from gateway.prompts import check_fits, tokenize_chat, tokenize_prompt
from gateway.router import Candidate, pick_least_loaded
from gateway.service import GatewayServicer, generation_request
from gateway.targets import Target, parse_target, parse_target_list, resolve
from gateway.worker_calls import decode_stub, prefill_stub
from gateway.workers import WorkerPool
from kvstore.client import KVStoreClient
from kvstore.server import serve as serve_kvstore
from pdserve.grpc_server import ServiceError, grpc_channel, start_server, stop_server
from pdserve.kvwire import encode_block
from pdserve.proto_convert import sampling_from_proto, sampling_to_proto
from pdserve.runtime.kv_format import KVFormat
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

# ---- router -------------------------------------------------------------------------------------


def _cands(*loads: int | None) -> list[Candidate]:
    """None = unhealthy."""
    return [Candidate(f"w{i}", load is not None, load or 0) for i, load in enumerate(loads)]


def test_router_picks_least_loaded_healthy() -> None:
    assert pick_least_loaded(_cands(3, 1, 2), cursor=0) == 1
    assert pick_least_loaded(_cands(3, None, 2), cursor=0) == 2  # unhealthy never wins, even idle
    assert pick_least_loaded(_cands(None, None), cursor=0) is None
    assert pick_least_loaded([], cursor=5) is None


def test_router_breaks_ties_round_robin() -> None:
    cands, cursor, picks = _cands(0, 0, 0), 0, []
    for _ in range(6):
        i = pick_least_loaded(cands, cursor)
        picks.append(i)
        cursor = i + 1
    assert picks == [0, 1, 2, 0, 1, 2]
    assert pick_least_loaded(_cands(0, 5, 0), cursor=1) == 2  # first tie at or after the cursor
    assert pick_least_loaded(_cands(0, 5, 1), cursor=7) == 0  # the cursor wraps around

# ---- targets ------------------------------------------------------------------------------------


def test_parse_targets() -> None:
    assert parse_target("127.0.0.1:50061") == Target("127.0.0.1", 50061, False)
    assert parse_target("dns:///prefill:50061") == Target("prefill", 50061, True)
    assert parse_target("dns:prefill:50061") == Target("prefill", 50061, True)
    assert parse_target("[::1]:7") == Target("::1", 7, False)
    assert parse_target("[::1]:7").address == "[::1]:7"
    assert str(parse_target("dns:///decode:9")) == "dns:///decode:9"
    assert parse_target_list("a:1, dns:///b:2") == [Target("a", 1), Target("b", 2, True)]
    for bad in ["prefill", "host:", ":80", "h:99999", "dns://8.8.8.8/h:1", ""]:
        with pytest.raises(ValueError):
            parse_target_list(bad)


def test_resolve_dns_target_gives_every_address() -> None:
    assert asyncio.run(resolve(parse_target("dns:///localhost:5000"))) == ["127.0.0.1:5000"]
    assert asyncio.run(resolve(parse_target("localhost:5000"))) == ["localhost:5000"]  # gRPC resolves

# ---- conversion and validation ------------------------------------------------------------------


def test_sampling_defaults_and_round_trip() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams(
        max_tokens=16, temperature=1.0, top_p=1.0, repetition_penalty=1.0, seed=None)
    params = SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=7, stop=("x",),
                            stop_token_ids=(9,), ignore_eos=True, logprobs=2)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert not sampling_to_proto(SamplingParams()).HasField("seed")


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
])
def test_bad_sampling_is_a_value_error(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        generation_request(gateway_pb2.GenerateRequest(prompt="x", sampling=common_pb2.SamplingParams(**fields)))


def test_request_ids_and_chat_messages() -> None:
    req = generation_request(gateway_pb2.GenerateRequest(prompt="hi"))
    assert len(req.request_id) == 32 and req.messages is None and req.prompt == "hi"
    chat = generation_request(gateway_pb2.ChatRequest(
        request_id="r1", messages=[gateway_pb2.ChatMessage(role="user", content="Hi")]))
    assert chat.client_request_id == chat.public_id == "r1" and len(chat.request_id) == 32  # the gateway's own
    assert chat.messages == ({"role": "user", "content": "Hi"},)


def test_prompt_validation(model: ModelInfo) -> None:
    tok = model.tokenizer
    with pytest.raises(ValueError, match="prompt is empty"):
        tokenize_prompt(tok, "")
    with pytest.raises(ValueError, match="messages is empty"):
        tokenize_chat(tok, [])
    with pytest.raises(ValueError, match="unsupported chat role 'robot'"):
        tokenize_chat(tok, [{"role": "robot", "content": "beep"}])
    assert tokenize_chat(tok, [{"role": "user", "content": "Hi"}]) == tok.encode("user: Hi\nassistant:")
    with pytest.raises(ValueError, match=r"prompt \(3 tokens\) \+ max_tokens \(2046\) = 2049 tokens "
                                         r"exceeds the model's context window of 2048"):
        check_fits([1, 2, 3], SamplingParams(max_tokens=2046), 2048)
    check_fits([1, 2, 3], SamplingParams(max_tokens=2045), 2048)
    # A prompt that fills the window alone: the fix is the prompt's, never "max_tokens at most 0".
    with pytest.raises(ValueError, match=r"shorten the prompt to at most 2047 tokens$"):
        check_fits(list(range(2048)), SamplingParams(max_tokens=1), 2048)


def test_inflight_limit() -> None:
    limit = InflightLimit(1)
    with limit.admit():
        with pytest.raises(ServiceError, match="limit of 1 requests") as err:
            with limit.admit():
                pass
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with limit.admit():
        assert limit.inflight == 1


def test_output_assembler_stop_string(model: ModelInfo) -> None:
    tok = model.tokenizer
    prompt = tok.encode("Once")
    out = OutputAssembler(tok, prompt, SamplingParams(stop=("little",)), len(prompt), 0)
    text = out.add(tok.encode(" upon a time", add_bos=False)).text
    last = out.add(tok.encode(" there was a little girl", add_bos=False))
    assert text + last.text == " upon a time there was a "
    assert last.finish_reason == "stop" and last.usage.prompt_tokens == len(prompt)

# ---- the request flow against fake workers ------------------------------------------------------

STORY = " upon a time, there was a little girl."


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, first_token: int) -> None:
        self.first_token, self.finish_reason, self.fail = first_token, "", None
        self.calls: list[worker_pb2.PrefillRequest] = []

    async def Prefill(self, request, context):
        self.calls.append(request)
        if self.fail is not None:
            await context.abort(self.fail, "fake prefill failure")
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, first_token=self.first_token, block_hashes=[b"h" * 16],
            prompt_tokens=len(request.token_ids), cached_tokens=0, finish_reason=self.finish_reason)


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.delay_s, self.fail_at = tokens, 0.0, None
        self.address = ""
        self.prepared: list[str] = []
        self.prepared_hashes: list[list[bytes]] = []
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.cancelled = asyncio.Event()

    async def Prepare(self, request, context):
        self.prepared.append(request.request_id)
        self.prepared_hashes.append(list(request.block_hashes))
        return worker_pb2.PrepareResponse()

    async def Decode(self, request, context):
        self.requests.append(request)
        try:
            for i, token in enumerate(self.tokens):
                if i == self.fail_at:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker going away")
                await asyncio.sleep(self.delay_s)
                last = i == len(self.tokens) - 1
                yield worker_pb2.DecodeChunk(token_ids=[token], finish_reason="length" if last else "")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


class RecordingKVStore(KVStoreClient):
    """A real kvstore client that also records the leases the gateway ends."""

    def __init__(self, target: str) -> None:
        super().__init__(target, timeout_s=2)
        self.released: list[str] = []

    async def release(self, request_id: str, drop: bool = False) -> int:
        self.released.append(request_id)
        return await super().release(request_id, drop)


@dataclass
class Stack:
    prefill: list[FakePrefill]
    decode: FakeDecode
    stub: gateway_pb2_grpc.GatewayStub
    flow: RequestFlow
    kv: RecordingKVStore

    async def released(self) -> list[str]:
        """Lease releases run in the background: until one is seen, or a deadline."""
        deadline = time.monotonic() + 30
        while not self.kv.released and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.kv.released


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return gateway_server.load_model_info(None, 16, "float32")


async def _fake_server(servicer, add) -> tuple[grpc.aio.Server, str]:
    server, port = await start_server("127.0.0.1:0", lambda s: add(servicer, s), ["fake"])
    return server, f"127.0.0.1:{port}"


@asynccontextmanager
async def gateway_stack(model: ModelInfo, prefill_workers: int = 2, max_inflight: int = 8,
                        decode_target: str | None = None, decode_via_dns: bool = False) -> AsyncIterator[Stack]:
    tok = model.tokenizer
    story = tok.encode(STORY, add_bos=False)
    prefills = [FakePrefill(story[0]) for _ in range(prefill_workers)]
    decode = FakeDecode(story[1:])
    servers = [await _fake_server(p, worker_pb2_grpc.add_PrefillWorkerServicer_to_server) for p in prefills]
    servers.append(await _fake_server(decode, worker_pb2_grpc.add_DecodeWorkerServicer_to_server))
    decode.address = servers[-1][1]
    decode_port = servers[-1][1].rsplit(":", 1)[1]
    decode_target = decode_target or (f"dns:///localhost:{decode_port}" if decode_via_dns else servers[-1][1])
    pools = [WorkerPool("prefill", [parse_target(a) for _, a in servers[:-1]], prefill_stub),
             WorkerPool("decode", [parse_target(decode_target)], decode_stub)]
    for pool in pools:
        await pool.start()
    kv_server, kv_port = await serve_kvstore("127.0.0.1:0", 1 << 20)
    kv = RecordingKVStore(f"127.0.0.1:{kv_port}")
    flow = RequestFlow(model, *pools, kv, InflightLimit(max_inflight))
    server, port = await start_server(
        "127.0.0.1:0", lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(flow), s),
        [gateway_server.SERVICE_NAME])
    channel = grpc_channel(f"127.0.0.1:{port}")
    try:
        yield Stack(prefills, decode, gateway_pb2_grpc.GatewayStub(channel), flow, kv)
    finally:
        await channel.close()
        await kv.close()
        for s in [server, kv_server, *(s for s, _ in servers)]:
            await stop_server(s, 0)
        for pool in pools:
            await pool.close()


def _request(prompt: str = "Once", request_id: str = "r1", **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt,
                                       sampling=common_pb2.SamplingParams(**sampling))


async def _collect(call) -> list[gateway_pb2.GenerateResponse]:
    return [msg async for msg in call]


async def _status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _collect(call)
    return err.value.code(), err.value.details()


def test_generate_streams_first_token_then_decode(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model, decode_via_dns=True) as st:
            assert [ep.address for ep in st.flow.decode_pool.endpoints] == [st.decode.address]
            chunks = await _collect(st.stub.Generate(_request(max_tokens=20)))
            assert "".join(c.text for c in chunks) == STORY
            assert [t for c in chunks for t in c.token_ids] == model.tokenizer.encode(STORY, add_bos=False)
            assert [c.finish_reason for c in chunks][-1] == "length" and not any(c.finish_reason for c in chunks[:-1])
            assert chunks[-1].usage.completion_tokens == len(st.decode.tokens) + 1
            assert chunks[-1].usage.prompt_tokens == len(model.tokenizer.encode("Once"))
            # Downstream the request has the gateway's own id; the client's ("r1") is only echoed.
            assert {c.request_id for c in chunks} == {"r1"} and st.decode.requests[0].request_id != "r1"
            assert st.decode.requests[0].first_token == chunks[0].token_ids[0]
            assert st.decode.prepared == []  # no dispatch hint: the kvstore holds none of the prompt
            assert sum(len(p.calls) for p in st.prefill) == 1
            assert [p.calls[0].cached_blocks for p in st.prefill if p.calls] == [0]  # asked the kvstore
            # The decode worker ends the lease once it holds the KV; the gateway too once the request
            # ended (a worker killed between its last chunk and its release would leave it pinned).
            assert await st.released() == [st.decode.requests[0].request_id]
    asyncio.run(scenario())


def test_the_dispatch_hint_names_the_leading_blocks_the_kvstore_holds(model: ModelInfo) -> None:
    """Prepare(dispatch) tells the decode worker to fetch KV that exists: with the prompt's first
    block in the store, the hint names that block alone; the gateway's own id goes with it."""
    fmt = KVFormat.named("0" * 32, "float32", 1, 1, 4, 16)
    wire = encode_block(torch.zeros(fmt.shape), fmt, 16)

    async def scenario() -> None:
        async with gateway_stack(model) as st:
            await _collect(st.stub.Generate(_request(prompt=STORY * 6, max_tokens=4)))
            prompt_ids = list(next(p.calls[0] for p in st.prefill if p.calls).token_ids)
            hashes = model.block_names.full_block_hashes(prompt_ids)
            assert len(hashes) >= 2 and st.decode.prepared == []
            await st.kv.put_blocks("", [(hashes[0], wire)])
            await _collect(st.stub.Generate(_request(prompt=STORY * 6, request_id="r2", max_tokens=4)))
            assert st.decode.prepared_hashes == [[hashes[0]]]
            assert st.decode.prepared == [st.decode.requests[-1].request_id]
    asyncio.run(scenario())


def test_stop_string_cancels_decode(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model) as st:
            st.decode.delay_s = 0.05
            chunks = await _collect(st.stub.Generate(_request(stop=["little"])))
            assert "".join(c.text for c in chunks) == " upon a time, there was a "
            assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens < len(st.decode.tokens)
            await asyncio.wait_for(st.decode.cancelled.wait(), 5)
    asyncio.run(scenario())


def test_first_token_finish_skips_decode(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model) as st:
            for p in st.prefill:
                p.finish_reason = "length"
            chunks = await _collect(st.stub.Generate(_request(max_tokens=1)))
            assert len(chunks) == 1 and chunks[0].finish_reason == "length"
            assert chunks[0].usage.completion_tokens == 1 and not st.decode.requests
            assert len(await st.released()) == 1  # nobody else would end the request's kvstore lease
    asyncio.run(scenario())


def test_prefill_retries_once_on_unavailable(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model) as st:
            st.prefill[0].fail = grpc.StatusCode.UNAVAILABLE
            st.flow.prefill_pool._cursor = 0  # the failing worker goes first
            chunks = await _collect(st.stub.Generate(_request()))
            assert chunks[-1].finish_reason == "length"
            assert [len(p.calls) for p in st.prefill] == [1, 1]
            st.prefill[1].fail = grpc.StatusCode.UNAVAILABLE  # [0] is down, [1] fails now: the
            chunks = await _collect(st.stub.Generate(_request()))  # decode worker prefills instead
            assert chunks[-1].finish_reason == "length" and [len(p.calls) for p in st.prefill] == [1, 2]
            assert st.decode.requests[-1].local_prefill and not st.decode.requests[0].local_prefill
            st.prefill[1].fail = grpc.StatusCode.RESOURCE_EXHAUSTED  # passed through, not retried
            st.prefill[0].fail = None
            await st.flow.prefill_pool.refresh()
            st.flow.prefill_pool._cursor = 1
            code, details = await _status_of(st.stub.Generate(_request()))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "fake prefill failure" in details
    asyncio.run(scenario())


def test_errors_are_actionable(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model, decode_target="127.0.0.1:1") as st:
            code, details = await _status_of(st.stub.Generate(_request()))
            # Which worker is down is the operator's business (the gateway's log), not the client's.
            assert code == grpc.StatusCode.UNAVAILABLE and details.startswith("no healthy decode worker: <internal>")
            assert "127.0.0.1" not in details
            code, details = await _status_of(st.stub.Generate(_request(prompt="")))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "prompt is empty"
            code, details = await _status_of(st.stub.Generate(_request(max_tokens=5000)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "5000" in details and "2048" in details
            code, details = await _status_of(st.stub.Chat(gateway_pb2.ChatRequest(
                messages=[gateway_pb2.ChatMessage(role="robot", content="x")])))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "robot" in details
            code, details = await _status_of(st.stub.Generate(_request(temperature=-1)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details
    asyncio.run(scenario())


def test_decode_failure_deadline_cancel_and_limit(model: ModelInfo) -> None:
    async def scenario() -> None:
        async with gateway_stack(model, max_inflight=1) as st:
            st.decode.fail_at = 3  # dies mid-stream: the stream ends with UNAVAILABLE
            code, details = await _status_of(st.stub.Generate(_request()))
            assert code == grpc.StatusCode.UNAVAILABLE and "during decode" in details
            assert len(await st.released()) == 1
            await st.flow.decode_pool.refresh()  # probed healthy again
            st.decode.fail_at, st.decode.delay_s = None, 0.2
            start = time.monotonic()
            code, _ = await _status_of(st.stub.Generate(_request(), timeout=0.5))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 2
            await asyncio.wait_for(st.decode.cancelled.wait(), 5)  # the timeout reached the worker
            st.decode.cancelled.clear()
            call = st.stub.Generate(_request())
            await call.read()  # the first token: the request is in flight
            code, details = await _status_of(st.stub.Generate(_request(request_id="r2")))  # "r1" is in flight
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-inflight" in details
            call.cancel()  # a client cancel reaches the decode worker
            await asyncio.wait_for(st.decode.cancelled.wait(), 5)
            deadline = time.monotonic() + 30  # the slot frees once the handler has unwound
            while st.flow.limit.inflight != 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert st.flow.limit.inflight == 0
    asyncio.run(scenario())


def test_sessions_are_scoped_by_api_key(model: ModelInfo) -> None:
    """Two callers with different keys who send the same session_id are two sessions: one's turns
    never give the other a routing home or a prefetch (the gateway tracks tenant/session)."""
    from gateway.request_ids import tenant_of
    from gateway.sessions import SessionTracker

    async def scenario() -> None:
        async with gateway_stack(model) as st:
            st.flow.sessions = tracker = SessionTracker()
            request = gateway_pb2.GenerateRequest(prompt="Once", session_id="chat-1",
                                                  sampling=common_pb2.SamplingParams(max_tokens=4))
            await _collect(st.stub.Generate(request, metadata=(("authorization", "Bearer key-a"),)))
            key_a = f"{tenant_of('Bearer key-a')[:32]}/chat-1"
            assert tracker.prefill_home(key_a)  # A's turn ran: its session has a home
            assert tracker.prefill_home("chat-1") == ""  # ...kept under A's key only
            assert tracker.arrival(f"{tenant_of('Bearer key-b')[:32]}/chat-1") == ""  # B starts fresh
    asyncio.run(scenario())
