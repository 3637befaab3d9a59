"""The gateway's request limits (gateway.request_limits), at both edges, with one in-process gateway.

Every limit is checked before any worker is asked, so the gateway here has no workers at all (a
request within the limits gets UNAVAILABLE / 503: it passed validation). Each limit is exceeded
once over gRPC and once over HTTP and must give INVALID_ARGUMENT / 400 naming its flag; bodies
over --max-request-bytes get RESOURCE_EXHAUSTED (gRPC's receive limit) / 413.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp
import grpc
import pytest

from gateway import request_limits
from gateway import server as gateway_server
from gateway.config import GatewayConfig
from gateway.flow import GenerationRequest
from gateway.request_limits import RequestLimits
from pdserve.ports import free_port
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

LIMITS = RequestLimits(max_prompt_tokens=20, max_tokens=50, max_stop_strings=2, max_stop_chars=8, max_messages=3,
                       max_request_bytes=4096)
MODEL = "stories260K"


def test_limits_unit():
    ok = GenerationRequest("r", SamplingParams(max_tokens=50, stop=("ab", "12345678")), prompt="x")
    LIMITS.check_request(ok)
    LIMITS.check_tokens(list(range(20)), ok.sampling)
    cases = [
        (replace(ok, sampling=SamplingParams(stop=("a", "b", "c"))), "--max-stop-strings"),
        (replace(ok, sampling=SamplingParams(stop=("123456789",))), "--max-stop-chars"),
        (replace(ok, messages=tuple({"role": "user", "content": "x"} for _ in range(4))), "--max-messages"),
    ]
    for request, flag in cases:
        with pytest.raises(ValueError, match=flag):
            LIMITS.check_request(request)
    with pytest.raises(ValueError, match="21 tokens.*--max-prompt-tokens"):
        LIMITS.check_tokens(list(range(21)), ok.sampling)
    with pytest.raises(ValueError, match="max_tokens 51.*--max-tokens-limit.*at most 50"):
        LIMITS.check_tokens([1], SamplingParams(max_tokens=51))
    with pytest.raises(ValueError, match="--max-messages must be >= 1"):
        RequestLimits(max_messages=0)
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match="stop_token_ids must be >= 0"):
        SamplingParams(stop_token_ids=(3, -1))


def test_id_and_character_limits_unit():
    limits = RequestLimits(max_prompt_tokens=20, max_chars_per_token=4, max_id_chars=8)
    ok = GenerationRequest("r", SamplingParams(), prompt="x", session_id="s" * 8, client_request_id="c" * 8)
    limits.check_ids(ok)
    with pytest.raises(ValueError, match=r"request_id \(HTTP: X-Request-Id\) has 9 characters.*--max-id-chars"):
        limits.check_ids(replace(ok, client_request_id="c" * 9))
    with pytest.raises(ValueError, match=r"session_id \(HTTP: user\) has 9 characters.*--max-id-chars"):
        limits.check_ids(replace(ok, session_id="s" * 9))
    limits.check_chars(80, context_window=100)  # 20 tokens x 4 characters
    with pytest.raises(ValueError, match="81 characters, over this gateway's limit of 80.*--max-chars-per-token"):
        limits.check_chars(81, context_window=100)
    with pytest.raises(ValueError, match="limit of 40 \\(10 tokens"):  # the context window is the smaller bound
        limits.check_chars(41, context_window=10)


def test_limits_flags():
    import argparse
    parser = argparse.ArgumentParser()
    request_limits.add_arguments(parser)
    assert request_limits.limits_from_args(parser.parse_args([])) == RequestLimits()
    args = parser.parse_args(["--max-tokens-limit", "7", "--max-request-bytes", "1000", "--max-id-chars", "9",
                              "--http-header-timeout-s", "3"])
    assert request_limits.limits_from_args(args) == RequestLimits(max_tokens=7, max_request_bytes=1000, max_id_chars=9,
                                                                  http_header_timeout_s=3)


def _sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, **kw})


async def _grpc_status(stub, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in getattr(stub, method)(request, timeout=10):
            pass
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


async def _check_both_edges() -> None:
    dead = f"127.0.0.1:{free_port()}"
    server, port = await gateway_server.serve("127.0.0.1:0", dead, dead, None, None, http_bind="127.0.0.1:0",
                                              settings=GatewayConfig(limits=LIMITS))
    base = f"http://127.0.0.1:{gateway_server.http_server(server).port}"
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    long_prompt = "the cat sat on the mat " * 10
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            def generate(prompt: str = "Hi", **kw) -> gateway_pb2.GenerateRequest:
                return gateway_pb2.GenerateRequest(prompt=prompt, sampling=_sampling(**kw))
            within = await _grpc_status(stub, "Generate", generate())
            assert within[0] == grpc.StatusCode.UNAVAILABLE  # validated; no worker to run it
            for request, flag in [(generate(max_tokens=51), "--max-tokens-limit"),
                                  (generate(stop=["a", "b", "c"]), "--max-stop-strings"),
                                  (generate(stop=["123456789"]), "--max-stop-chars"),
                                  (generate(long_prompt), "--max-prompt-tokens"),
                                  (generate("y" * 400), "--max-chars-per-token")]:  # over 20 tokens x 16
                code, details = await _grpc_status(stub, "Generate", request)
                assert code == invalid and flag in details, (flag, code, details)
            many = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="x")] * 4,
                                           sampling=_sampling())
            code, details = await _grpc_status(stub, "Chat", many)
            assert code == invalid and "--max-messages" in details
            code, details = await _grpc_status(stub, "Generate", generate("x" * 5000))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4096" in details

        async with aiohttp.ClientSession() as session:
            url = base + "/v1/chat/completions"
            for body, flag in [({**chat, "max_tokens": 51}, "--max-tokens-limit"),
                               ({**chat, "stop": ["123456789"]}, "--max-stop-chars"),
                               ({**chat, "messages": chat["messages"] * 4}, "--max-messages"),
                               ({**chat, "messages": [{"role": "user", "content": long_prompt}]},
                                "--max-prompt-tokens"),
                               ({**chat, "messages": [{"role": "user", "content": "y" * 400}]}, "--max-chars-per-token")]:
                async with session.post(url, json=body) as r:
                    assert r.status == 400 and flag in (await r.json())["error"]["message"], flag
            async with session.post(url, json={k: v for k, v in chat.items() if k != "max_tokens"}) as r:
                assert r.status == 503  # the default max_tokens (capped to 50) passed validation
            async with session.post(url, json={**chat, "messages": [{"role": "user", "content": "x" * 5000}]}) as r:
                assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
    finally:
        await gateway_server.stop(server, grace_s=1)


def test_limits_at_both_edges():
    asyncio.run(_check_both_edges())
