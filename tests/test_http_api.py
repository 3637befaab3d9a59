"""The OpenAI-compatible HTTP API against a real stack, with the official `openai` client.

One stack (1 prefill, 1 decode, HTTP on a free port) for the module. Greedy answers must equal
the gRPC API's for the same request, usage must count the same tokens, SSE is checked byte by
byte once, and every error case gets its status and OpenAI's error body. Queue-full (429),
client disconnect and no-workers (503) run an in-process gateway (the same `serve`) next to it.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import grpc
import openai
import pytest

from gateway import server as gateway_server
from pdserve.ports import free_port
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "Tom had a red ball. He"]


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--http-port", str(free_port()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    # No retries: a 429 or 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_chat(stack, messages, max_tokens: int, **sampling) -> tuple[str, list[int], common_pb2.Usage]:
    req = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                                  sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    chunks = list(stack.gateway_stub().Chat(req, timeout=60))
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].usage


def grpc_generate(stack, prompt: str, max_tokens: int, **sampling) -> tuple[str, list[int], common_pb2.Usage]:
    req = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    chunks = list(stack.gateway_stub().Generate(req, timeout=60))
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].usage


# ---- answers equal the gRPC API's ------------------------------------------------------------

def test_chat_whole_and_streamed_equal_grpc(stack, client):
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text, ids, usage = grpc_chat(stack, messages, 24, temperature=0)

        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        assert whole.object == "chat.completion" and whole.model == MODEL
        choice = whole.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", text)
        assert choice.finish_reason == "length"
        assert whole.usage.prompt_tokens == usage.prompt_tokens
        assert whole.usage.completion_tokens == len(ids) == 24
        assert whole.usage.total_tokens == usage.prompt_tokens + 24

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in [c for c in chunks if c.choices][:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_completions_whole_and_streamed_equal_grpc(stack, client):
    for prompt in PROMPTS:
        text, ids, usage = grpc_generate(stack, prompt, 20, temperature=0)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert whole.object == "text_completion"
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (usage.prompt_tokens, len(ids))

        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.usage is None for c in chunks)  # no usage unless asked for


def test_stop_seed_and_default_max_tokens(stack, client):
    prompt = PROMPTS[0]
    full, _, _ = grpc_generate(stack, prompt, 20, temperature=0)
    stop = full.split()[2]  # a word from the middle of the greedy answer
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]

    seeded = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a, b = (client.completions.create(**seeded).choices[0].text for _ in range(2))
    assert a == b == grpc_generate(stack, prompt, 16, temperature=1.0, top_p=0.9, seed=1234)[0]

    # Without max_tokens the answer may use the whole context window; a stop string ends it early.
    text, _, _ = grpc_generate(stack, prompt, 40, temperature=0)
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0, stop=[text[30:36]])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].text == text[:text.index(text[30:36])]


def test_user_is_accepted_and_chat_history_counts(stack, client):
    messages = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"},
                {"role": "assistant", "content": "sat on a mat."}, {"role": "user", "content": [
                    {"type": "text", "text": "And then"}, {"type": "text", "text": "?"}]}]
    grpc_messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else "And then?"}
                     for m in messages]
    text, _, usage = grpc_chat(stack, grpc_messages, 12, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                         user="session-42")
    assert out.choices[0].message.content == text and out.usage.prompt_tokens == usage.prompt_tokens


# ---- wire format ------------------------------------------------------------------------------

def _raw_http(url: str, method: str, path: str, body: bytes = b"") -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.1 exchange on a plain socket: status line, headers, the de-chunked body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    if headers.get("transfer-encoding") == "chunked":
        body_out = b""
        while True:
            size_line, _, raw = raw.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body_out, raw = body_out + raw[:size], raw[size + 2:]
        return status, headers, body_out
    return status, headers, raw


def test_sse_framing_bytes(stack):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    status, headers, payload = _raw_http(stack.http_url, "POST", "/v1/chat/completions", body)
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache"
    # Nothing but `data: <one line>` events, each ended by a blank line, [DONE] last.
    assert re.fullmatch(rb"(data: [^\n]+\n\n)+", payload), payload
    events = payload.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 5
    assert all(o["object"] == "chat.completion.chunk" and o["usage"] is None for o in objs[:-1])


# ---- the other endpoints ----------------------------------------------------------------------

def test_models_health_metrics_page(stack, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")

    with urllib.request.urlopen(stack.http_url + "/health", timeout=10) as r:
        assert r.status == 200 and json.load(r)["status"] == "ok"
    def metrics() -> str:
        with urllib.request.urlopen(stack.http_url + "/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=")
            return r.read().decode()

    def ok_requests(text: str) -> float:
        return sum(float(v) for v in re.findall(  # every model_name's (labels are written sorted)
            r'^pdserve_requests_total\{model_name="[^"]*",status="OK"\} (\S+)$', text, re.M))

    before = ok_requests(metrics())
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    text = metrics()
    assert ok_requests(text) == before + 1  # HTTP requests count in the gateway's request metrics
    assert "# TYPE pdserve_gateway_http_requests_total counter" in text
    assert re.search(r'pdserve_gateway_http_requests_total\{route="/v1/models",status="200"\} [1-9]', text)
    with urllib.request.urlopen(stack.http_url + "/", timeout=10) as r:
        assert r.headers["Content-Type"] == "text/html; charset=utf-8"
        assert b"/v1/chat/completions" in r.read()


# ---- errors -----------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ERRORS = [  # (path, body, status, param, code)
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": "8"}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "n", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 400, "seed", None),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", None),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0]", None),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model", None),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt", None),  # not in the vocabulary
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2047}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "Hi " * 2100}, 400, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), ERRORS,
                         ids=[f"{s}-{p}" for _, _, s, p, _ in ERRORS])
def test_error_status_and_body(stack, path, body, status, param, code):
    got_status, _, payload = _raw_http(stack.http_url, "POST", path, json.dumps(body).encode())
    assert got_status.split()[1] == str(status)
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=17)
    assert bad.value.status_code == 400 and bad.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="davinci", prompt="Hi")
    assert missing.value.code == "model_not_found"


def test_malformed_requests(stack):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        status, headers, payload = _raw_http(stack.http_url, "POST", "/v1/chat/completions", raw)
        assert status.split()[1] == "400" and headers["content-type"].startswith("application/json")
        assert json.loads(payload)["error"]["type"] == "invalid_request_error"
    status, _, payload = _raw_http(stack.http_url, "GET", "/v1/chat/completions")
    assert status.split()[1] == "405" and json.loads(payload)["error"]["code"] == "method_not_allowed"
    status, _, payload = _raw_http(stack.http_url, "GET", "/v2/nothing")
    assert status.split()[1] == "404" and json.loads(payload)["error"]["code"] == "unknown_url"
    with pytest.raises(urllib.error.HTTPError) as big:  # over the body limit: still OpenAI's shape
        urllib.request.urlopen(urllib.request.Request(stack.http_url + "/v1/completions", data=b" " * (9 << 20)),
                               timeout=30)
    assert big.value.code == 413 and "error" in json.load(big.value)


# ---- queue full, disconnect, no workers (an in-process gateway beside the stack) ----------------

def _idle(stack) -> bool:
    decode, kv = stack.worker_stats("decode-0"), stack.kvstore_stats()
    return (decode.num_running == 0 and decode.num_waiting == 0 and decode.num_blocks_free == decode.num_blocks_total
            and kv.num_pinned == 0 and kv.num_leases == 0)


async def _wait_idle(stack, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(_idle, stack):
            return True
        await asyncio.sleep(0.05)
    return False


async def _queue_full_and_disconnect(stack) -> None:
    workers = {n: stack.child(n).spec.address for n in ("prefill-0", "decode-0", "kvstore")}
    server, _ = await gateway_server.serve("127.0.0.1:0", workers["prefill-0"], workers["decode-0"],
                                           workers["kvstore"], None, max_inflight=1, http_bind="127.0.0.1:0")
    url = f"http://127.0.0.1:{gateway_server.http_server(server).port}/v1/chat/completions"
    cancelled0, busy0 = _requests("CANCELLED"), _requests("RESOURCE_EXHAUSTED")
    long_request = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            first = await session.post(url, json=long_request)
            assert first.status == 200
            assert (await first.content.readuntil(b"\n\n")).startswith(b"data: ")  # it is running
            async with session.post(url, json=CHAT) as refused:
                assert refused.status == 429 and refused.headers["Retry-After"] == "1"
                error = (await refused.json())["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert "--max-inflight" in error["message"]
            first.close()  # the client goes away mid-stream: the decode worker must free the KV
            assert await _wait_idle(stack), (stack.worker_stats("decode-0"), stack.kvstore_stats())
            async with session.post(url, json=CHAT) as again:  # its slot is free again
                assert again.status == 200 and (await again.json())["usage"]["completion_tokens"] == 4
            # A non-streamed request writes nothing until it ends: only the handler's cancellation
            # on disconnect can stop it early.
            with pytest.raises(asyncio.TimeoutError):
                await session.post(url, json={**long_request, "stream": False}, timeout=aiohttp.ClientTimeout(total=1))
            assert await _wait_idle(stack), (stack.worker_stats("decode-0"), stack.kvstore_stats())
            # Both disconnects are cancels in the request metrics, not server errors.
            assert (_requests("CANCELLED") - cancelled0, _requests("RESOURCE_EXHAUSTED") - busy0) == (2, 1)
    finally:
        await gateway_server.stop(server, grace_s=1)


def _requests(status: str) -> float:
    """pdserve_requests_total{status} of this process (where the in-process gateway runs)."""
    from prometheus_client import REGISTRY

    return sum(s.value for family in REGISTRY.collect() for s in family.samples  # any model_name
               if s.name == "pdserve_requests_total" and s.labels.get("status") == status)


async def _no_workers() -> None:
    dead = f"127.0.0.1:{free_port()}"
    server, grpc_port = await gateway_server.serve("127.0.0.1:0", dead, dead, None, None, http_bind="127.0.0.1:0")
    base = f"http://127.0.0.1:{gateway_server.http_server(server).port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/health") as health:
                assert health.status == 503 and (await health.json())["status"] == "unavailable"
            async with session.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                assert r.status == 503  # refused before the stream starts: a real status, not an SSE event
                error = (await r.json())["error"]
                assert (error["type"], error["code"]) == ("service_unavailable", "service_unavailable")
                assert "no healthy" in error["message"] and dead not in error["message"]
        # The gRPC API's clients are told as little: the same status, no address either.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi"), timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy" in err.value.details()
            assert dead not in err.value.details() and "127.0.0.1" not in err.value.details()
    finally:
        await gateway_server.stop(server, grace_s=1)


def test_queue_full_429_and_disconnect_frees_kv(stack):
    asyncio.run(_queue_full_and_disconnect(stack))


def test_no_workers_503():
    asyncio.run(_no_workers())


# ---- pdserve up's HTTP flags ------------------------------------------------------------------

def test_up_refuses_a_busy_http_port_and_reports_off():
    import subprocess
    import sys

    from pdserve.cli import build_parser
    from pdserve.commands.up import plan, ready_line

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "--grpc-port", str(free_port()),
                               "--http-port", str(port)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"cannot use --http-port {port} on 127.0.0.1" in proc.stderr

    args = build_parser().parse_args(["up", "--http-port", "0"])
    workers, gateway = plan(args)
    assert "--http-port" in gateway.command and gateway.command[gateway.command.index("--http-port") + 1] == "0"
    assert " http=off " in ready_line(args, workers, gateway)


# ---- failures after the stream started, and bugs (a fake flow, no stack) ------------------------

class _FakeFlow:
    """Duck-types what the handlers use of RequestFlow; `run` yields `chunks`, then raises `error`."""

    def __init__(self, chunks, error: BaseException | None) -> None:
        from types import SimpleNamespace

        from gateway.request_limits import RequestLimits

        self.chunks, self.error = chunks, error
        self.model = SimpleNamespace(context_window=64, tokenizer=SimpleNamespace(vocab_size=512),
                                     block_names=SimpleNamespace(fingerprint="0" * 32))
        self.limits = RequestLimits()
        self.prefill_pool = self.decode_pool = SimpleNamespace(endpoints=[], describe=lambda: "none")

    async def prompt_ids(self, request) -> list[int]:
        return [1, 2, 3]

    async def run(self, request, time_remaining):
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


async def _fake_gateway(flow: _FakeFlow, body: dict) -> tuple[int, bytes]:
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.http.app import create_app

    async with TestClient(TestServer(create_app(flow, MODEL))) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status, await resp.read()


def test_errors_after_the_first_token_and_unexpected_ones():
    import grpc

    from gateway.output import OutputChunk
    from pdserve.grpc_server import ServiceError

    died = ServiceError(grpc.StatusCode.UNAVAILABLE, "decode worker 127.0.0.1:1 went away")
    first = [OutputChunk("Once", (5,))]
    # Streamed: the status is already 200, so the error is the last event, without [DONE].
    status, payload = asyncio.run(_fake_gateway(_FakeFlow(first, died), {**CHAT, "stream": True}))
    events = payload.split(b"\n\n")[:-1]
    assert status == 200 and b"[DONE]" not in payload
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "service_unavailable"
    # The worker's address stays in the gateway's log: the client learns what failed, not where.
    assert "went away" in error["message"] and "127.0.0.1" not in error["message"]
    # Whole: the same failure is the response's status.
    status, payload = asyncio.run(_fake_gateway(_FakeFlow(first, died), CHAT))
    message = json.loads(payload)["error"]["message"]
    assert status == 503 and "went away" in message and "127.0.0.1" not in message
    status, payload = asyncio.run(_fake_gateway(
        _FakeFlow([], ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")), CHAT))
    assert status == 504
    # A bug: 500 in OpenAI's shape, the traceback only in the gateway's log.
    status, payload = asyncio.run(_fake_gateway(_FakeFlow([], RuntimeError("secret detail")), CHAT))
    error = json.loads(payload)["error"]
    assert status == 500 and error["type"] == "server_error" and "secret" not in payload.decode()
