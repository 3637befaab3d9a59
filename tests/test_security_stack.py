"""A whole stack with every security option on, against the in-process engine and outsiders.

One stack for the module (1 prefill, 1 decode, HTTP on): certificates made here (a CA and a
loopback certificate, `security_certs`), TLS on every port with mutual TLS between the internal
services, an internal token, and API keys at the gateway. Its greedy output over TLS must equal
the in-process engine's; a plaintext client, an internal call without a client certificate or
without the token, and gateway calls without a valid key must be refused with the documented
status; per-key rate and concurrency limits must refuse with RESOURCE_EXHAUSTED / 429. An
in-process gateway over the same workers (TLS, mTLS and token dialled by `grpc_channel`) shows
that no log line carries a prompt or an API key.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import STORIES_GGUF
from gateway import server as gateway_server
from gateway.config import GatewayConfig
from pdserve import internal_auth
from pdserve.tls import TlsConfig
from pdserve.ports import free_port
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, \
    worker_pb2_grpc
from security_certs import make_pki

TOKEN = "internal-7f3a9c1e"
GOOD_KEY = "sk-good-5d1f0e2b"
RATE_KEY = "sk-rate-9a8b7c6d"  # 2 requests, then 1 per minute
ONE_AT_A_TIME_KEY = "sk-conc-1e2d3c4b"
KEYS_FILE = f"""# test keys
{GOOD_KEY} name=good
{RATE_KEY} name=rated rate=1/m burst=2
{ONE_AT_A_TIME_KEY} name=single concurrency=1
"""
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stack(pki, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(KEYS_FILE)
    env = {"PDSERVE_TLS_CERT": str(pki.cert), "PDSERVE_TLS_KEY": str(pki.key), "PDSERVE_TLS_CA": str(pki.ca),
           "PDSERVE_TLS_CLIENT_AUTH": "1", "PDSERVE_INTERNAL_TOKEN": TOKEN, "PDSERVE_API_KEYS_FILE": str(keys)}
    s = start_stack(1, 1, "--http-port", str(free_port()), env=env)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    checkpoint = load_checkpoint(STORIES_GGUF)
    engine = Engine.from_checkpoint(checkpoint)

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        return engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0].output_ids
    return run, checkpoint.tokenizer


def tls_channel(address: str, pki, client_cert: bool = False, rogue: bool = False) -> grpc.Channel:
    cert, key = (pki.rogue_cert, pki.rogue_key) if rogue else (pki.cert, pki.key)
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), key.read_bytes() if client_cert else None,
                                         cert.read_bytes() if client_cert else None)
    return grpc.secure_channel(address, creds)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def generate(channel: grpc.Channel, key: str | None, max_tokens: int = 8, prompt: str = PROMPT) -> list[int]:
    req = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0))
    chunks = gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=60, metadata=bearer(key) if key else None)
    return [t for c in chunks for t in c.token_ids]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def test_tls_stack_serves_the_reference_output(stack, pki, reference):
    run, tokenizer = reference
    with tls_channel(stack.gateway_address, pki) as channel:
        for prompt in (PROMPT, "Tom had a red ball. He"):
            assert generate(channel, GOOD_KEY, 24, prompt) == run(tokenizer.encode(prompt), 24)


def test_plaintext_clients_are_refused(stack):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        code, _ = status_of(lambda: generate(channel, GOOD_KEY))
    assert code == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(stack.child("decode-0").spec.address) as channel:
        code, _ = status_of(lambda: worker_pb2_grpc.DecodeWorkerStub(channel).Stats(
            worker_pb2.StatsRequest(), timeout=5, metadata=((internal_auth.METADATA_KEY, TOKEN),)))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_internal_services_need_a_client_certificate_and_the_token(stack, pki):
    token = ((internal_auth.METADATA_KEY, TOKEN),)
    for name in ("decode-0", "prefill-0", "kvstore"):
        address = stack.child(name).spec.address
        if name == "kvstore":
            def stats(channel, metadata):
                return kvstore_pb2_grpc.KVStoreStub(channel).Stats(kvstore_pb2.KVStoreStatsRequest(), timeout=5,
                                                                   metadata=metadata)
        else:
            stub = worker_pb2_grpc.DecodeWorkerStub if name.startswith("decode") else worker_pb2_grpc.PrefillWorkerStub

            def stats(channel, metadata, stub=stub):
                return stub(channel).Stats(worker_pb2.StatsRequest(), timeout=5, metadata=metadata)
        for client_cert, rogue in ((False, False), (True, True)):  # no certificate; one of another CA
            with tls_channel(address, pki, client_cert, rogue) as channel:
                code, _ = status_of(lambda: stats(channel, token))
                assert code == grpc.StatusCode.UNAVAILABLE, (name, client_cert, rogue)
        with tls_channel(address, pki, client_cert=True) as channel:
            code, details = status_of(lambda: stats(channel, None))
            assert code == grpc.StatusCode.UNAUTHENTICATED and internal_auth.TOKEN_ENV in details
            code, _ = status_of(lambda: stats(channel, ((internal_auth.METADATA_KEY, "wrong"),)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            stats(channel, token)  # both: served
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without the token


def test_gateway_requires_a_valid_api_key(stack, pki):
    with tls_channel(stack.gateway_address, pki) as channel:
        code, details = status_of(lambda: generate(channel, None))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
        code, details = status_of(lambda: generate(channel, "sk-not-a-key"))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "not valid" in details and "sk-not" not in details
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_per_key_rate_and_concurrency_limits(stack, pki):
    with tls_channel(stack.gateway_address, pki) as channel:
        assert len(generate(channel, RATE_KEY, 2)) == 2  # the burst of 2
        assert len(generate(channel, RATE_KEY, 2)) == 2
        with pytest.raises(grpc.RpcError) as info:
            generate(channel, RATE_KEY, 2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in info.value.details()
        assert int(dict(info.value.trailing_metadata())["retry-after"]) >= 1
        assert len(generate(channel, GOOD_KEY, 2)) == 2  # other keys are not affected

        stub = gateway_pb2_grpc.GatewayStub(channel)
        long = stub.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
            max_tokens=400, temperature=0, ignore_eos=True)), timeout=60, metadata=bearer(ONE_AT_A_TIME_KEY))
        next(long)  # running: the key's one slot is taken
        code, details = status_of(lambda: generate(channel, ONE_AT_A_TIME_KEY, 2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in details
        long.cancel()
        deadline = time.monotonic() + 30  # the slot is freed once the cancelled call has ended on the gateway
        while True:
            try:
                assert len(generate(channel, ONE_AT_A_TIME_KEY, 2)) == 2
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the concurrency slot was never released"
                time.sleep(0.02)


async def _http_checks(stack, pki) -> None:
    context = ssl.create_default_context(cafile=str(pki.ca))
    base = stack.http_url.replace("http://", "https://")
    chat = {"model": "stories260K", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
        async with session.get(base + "/health") as r:
            assert r.status == 200  # open
        for headers in ({}, {"Authorization": "Bearer sk-not-a-key"}, {"Authorization": GOOD_KEY}):
            async with session.post(base + "/v1/chat/completions", json=chat, headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        good = {"Authorization": f"Bearer {GOOD_KEY}"}
        async with session.post(base + "/v1/chat/completions", json=chat, headers=good) as r:
            assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 8
        # The rated key spent its burst on gRPC: one bucket per key across both APIs.
        async with session.post(base + "/v1/chat/completions", json=chat,
                                headers={"Authorization": f"Bearer {RATE_KEY}"}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            await plain.get(stack.http_url + "/health")  # plaintext HTTP to the TLS port


def test_http_api_over_tls_with_keys(stack, pki):
    asyncio.run(_http_checks(stack, pki))


async def _in_process_gateway_request(stack, secret_prompt: str, secret_key: str, settings: GatewayConfig) -> None:
    workers = {n: stack.child(n).spec.address for n in ("prefill-0", "decode-0", "kvstore")}
    server, port = await gateway_server.serve("127.0.0.1:0", workers["prefill-0"], workers["decode-0"],
                                              workers["kvstore"], None, http_bind="127.0.0.1:0", settings=settings)
    try:
        config = settings.process.tls
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", config.channel_credentials()) as channel:
            req = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content=secret_prompt)],
                                          sampling=common_pb2.SamplingParams(max_tokens=6, temperature=0))
            chunks = [c async for c in gateway_pb2_grpc.GatewayStub(channel).Chat(req, metadata=bearer(secret_key))]
            assert sum(len(c.token_ids) for c in chunks) == 6
            with pytest.raises(grpc.aio.AioRpcError):  # a refused key goes through the log path too
                await gateway_pb2_grpc.GatewayStub(channel).Generate(
                    gateway_pb2.GenerateRequest(prompt=secret_prompt), metadata=bearer(secret_key + "x")).read()
    finally:
        await gateway_server.stop(server, grace_s=1)


def test_logs_carry_no_prompt_or_key(stack, pki, caplog, tmp_path, monkeypatch):
    secret_prompt, secret_key = "The zebra whispered xylophone-42 to", "sk-secret-0f9e8d7c6b"
    keys = tmp_path / "api-keys"
    keys.write_text(f"{secret_key} name=tenant\n")
    env = {**TlsConfig(str(pki.cert), str(pki.key), str(pki.ca), client_auth=True).env(),
           internal_auth.TOKEN_ENV: TOKEN, "PDSERVE_API_KEYS_FILE": str(keys), "PDSERVE_LOG_PROMPTS": "0"}
    # The gateway's settings as its main would build them; its worker pools and kvstore client
    # (which take no config yet) dial as the process environment says: the same environment.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = GatewayConfig.from_args(None, env)
    with caplog.at_level(logging.DEBUG):
        asyncio.run(_in_process_gateway_request(stack, secret_prompt, secret_key, settings))
    assert any("pdserve.v1.Gateway" in r.getMessage() for r in caplog.records)  # the capture works
    text = caplog.text
    assert secret_prompt not in text and "xylophone" not in text and secret_key not in text
    for child in [stack.gateway, *stack.workers]:  # nor do the stack's own processes
        output = child.last_output()
        assert GOOD_KEY not in output and RATE_KEY not in output and TOKEN not in output and PROMPT not in output
