"""`pdserve bench`'s clients (pdserve.bench.openai_client, pdserve.bench.client) against a real
stack's HTTP and gRPC APIs: every request completes with its exact token count and the gRPC API's
text for the same prompt, the chat endpoint likewise, and a sampled run's fields and seeds reach the
server (the same tokens through both APIs, not the greedy ones)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.ports import free_port
from pdserve.stack import start_stack
from test_http_api import PROMPTS, grpc_chat, grpc_generate


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--http-port", str(free_port()))
    yield s
    s.stop()


def bench_run(make_backend, max_tokens: int, **kwargs):
    """PROMPTS through `pdserve bench`'s client (`run_workload`) on the backend `make_backend()`
    makes inside the run's loop (a gRPC channel belongs to the loop it was made in)."""
    from pdserve.bench import workloads
    from pdserve.bench.client import run_workload

    convs = [workloads.Conversation(f"c{i}", (workloads.Turn(p, max_tokens),)) for i, p in enumerate(PROMPTS)]

    async def run():
        backend = make_backend()
        try:
            return await run_workload(backend, convs, [0.0] * len(convs), **kwargs)
        finally:
            await backend.close()
    return asyncio.run(run())


def test_bench_openai_backend_measures_this_api_like_the_grpc_one(stack):
    """`pdserve bench --openai-url`'s client against this HTTP API: every request completes with
    exactly its token count (the final usage corrects the per-chunk count) and the same text as
    the gRPC API's greedy run of the same prompt."""
    from pdserve.bench.openai_client import OpenAICompletions

    # the model id from GET /v1/models
    records = {r.conversation: r for r in bench_run(lambda: OpenAICompletions(stack.http_url, timeout_s=60), 12,
                                                    max_concurrency=2).records}
    for i, prompt in enumerate(PROMPTS):
        r = records[f"c{i}"]
        text, ids, usage = grpc_generate(stack, prompt, 12, temperature=0, ignore_eos=True)
        assert r.ok, r.error
        assert (r.text, r.output_tokens, r.prompt_tokens) == (text, 12, usage.prompt_tokens)
        assert r.ttft is not None and r.latency >= r.ttft and len(r.itl) >= 1

    failed = bench_run(lambda: OpenAICompletions(stack.http_url, model="no-such-model", timeout_s=60), 12).records[0]
    assert failed.status.startswith("HTTP_4") and "no-such-model" in failed.error


def test_bench_openai_chat_endpoint_measures_chat_completions(stack):
    """`pdserve bench --openai-endpoint chat`: each prompt goes as one user message to
    /v1/chat/completions, and the run's text and token counts are the gRPC Chat API's for it."""
    from pdserve.bench.openai_client import OpenAICompletions

    result = bench_run(lambda: OpenAICompletions(stack.http_url, timeout_s=60, chat=True), 12, max_concurrency=2)
    records = {r.conversation: r for r in result.records}
    for i, prompt in enumerate(PROMPTS):
        r = records[f"c{i}"]
        text, _, usage = grpc_chat(stack, [{"role": "user", "content": prompt}], 12, temperature=0, ignore_eos=True)
        assert r.ok, r.error
        assert (r.text, r.output_tokens, r.prompt_tokens) == (text, 12, usage.prompt_tokens)


def test_bench_backends_send_the_runs_sampling_with_a_seed_a_request(stack):
    """`pdserve bench --temperature ...`: both backends send the run's sampling fields and a seed
    derived from the request's id, so the HTTP API and the gRPC API answer each request with the
    tokens the gRPC API gives for those fields and that seed (and not the greedy ones)."""
    from pdserve.bench.client import GrpcGateway
    from pdserve.bench.openai_client import OpenAICompletions
    from pdserve.bench.sampling import RequestSampling

    sampling = RequestSampling(temperature=1.0, top_p=0.9, top_k=40, min_p=0.02, seed=7)
    texts = {}
    for name, make in (("http", lambda: OpenAICompletions(stack.http_url, timeout_s=60, sampling=sampling)),
                       ("grpc", lambda: GrpcGateway(stack.gateway_address, 60, sampling))):
        result = bench_run(make, 16, run_id="sampled")
        assert all(r.ok for r in result.records), [r.error for r in result.records]
        texts[name] = {r.conversation: r.text for r in result.records}
    assert texts["http"] == texts["grpc"]
    greedy = {f"c{i}": grpc_generate(stack, p, 16, temperature=0, ignore_eos=True)[0] for i, p in enumerate(PROMPTS)}
    assert texts["grpc"] != greedy
    with pytest.raises(ValueError, match="top_p"):
        RequestSampling(temperature=1.0, top_p=0.0)
