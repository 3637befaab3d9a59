"""Tracing across processes: one request through a real stack (kvstore, prefill, decode, gateway, each
its own process exporting to the same JSON-lines file) makes one trace whose spans come from all four
services and are parented as the request travelled; engine steps link to it; tracing off exports
nothing and installs nothing."""

from __future__ import annotations

import asyncio

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve import telemetry
from pdserve.v1 import common_pb2, gateway_pb2

REQUEST_ID = "trace-req-1"
# Longer than one 16-token block, so prefill puts blocks and decode gets them.
PROMPT = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog."


@pytest.fixture(scope="module")
def spans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict]]:
    """Every span the stack exported while serving one request (the stack is stopped afterwards)."""
    from pdserve.stack import start_stack

    path = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    old = os.environ.get(telemetry.TRACES_ENV)
    os.environ[telemetry.TRACES_ENV] = f"file:{path}"  # inherited by the stack's children
    try:
        stack = start_stack(1, 1)
    finally:
        if old is None:
            os.environ.pop(telemetry.TRACES_ENV)
        else:
            os.environ[telemetry.TRACES_ENV] = old
    try:
        request = gateway_pb2.GenerateRequest(prompt=PROMPT, request_id=REQUEST_ID, sampling=common_pb2.SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True))
        chunks = list(stack.gateway_stub().Generate(request, timeout=60))
        assert sum(len(c.token_ids) for c in chunks) == 8
        bad = gateway_pb2.GenerateRequest(prompt="", request_id="trace-bad", sampling=common_pb2.SamplingParams(
            max_tokens=4))
        with pytest.raises(grpc.RpcError) as err:
            list(stack.gateway_stub().Generate(bad, timeout=60))
        # the interceptors leave the status and its message as the servicer set them
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.value.details()
        yield _wait_for_spans(path, _complete)
    finally:
        stack.stop()


def _complete(rows: list[dict]) -> bool:
    """Both requests' gateway spans, the decode worker's server span (it ends after the gateway has
    its last chunk: the gateway then cancels the call) and the lease release are written."""
    names = [(r["service"], r["name"]) for r in rows]
    return (names.count(("pdserve-gateway", "/pdserve.v1.Gateway/Generate")) == 2
            and ("pdserve-decode", "/pdserve.v1.DecodeWorker/Decode") in names
            and ("pdserve-kvstore", "/pdserve.v1.KVStore/Release") in names)


def _wait_for_spans(path: Path, complete, timeout_s: float = 15.0) -> list[dict]:
    # Spans are written as they end; the last ones (server spans of finished streams, background
    # lease releases) may land a moment after the client saw its last chunk.
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if complete(rows):
            break
        time.sleep(0.1)
    return rows


def _one(rows: list[dict], name: str, service: str, **where) -> dict:
    found = [r for r in rows if r["name"] == name and r["service"] == f"pdserve-{service}"
             and all(r[k] == v for k, v in where.items())]
    assert len(found) == 1, f"expected one {name} span from {service}, found {len(found)}: " + \
        ", ".join(f"{r['service']}:{r['name']}" for r in rows)
    return found[0]


def _root(spans: list[dict]) -> dict:
    """The Generate server span of the good request."""
    request = next(r for r in spans if r["name"] == "gateway.request"
                   and r["attributes"]["pdserve.request_id"] == REQUEST_ID)
    return next(r for r in spans if r["span_id"] == request["parent_span_id"])


def test_one_trace_spans_all_four_services(spans: list[dict]) -> None:
    root = _root(spans)
    trace = [r for r in spans if r["trace_id"] == root["trace_id"]]
    assert {r["service"] for r in trace} == {"pdserve-gateway", "pdserve-prefill", "pdserve-kvstore", "pdserve-decode"}
    assert root["parent_span_id"] is None  # the bench/grpc client was not tracing: the gateway starts it


def test_spans_are_parented_as_the_request_travelled(spans: list[dict]) -> None:
    root = _root(spans)
    trace = [r for r in spans if r["trace_id"] == root["trace_id"]]
    by_id = {r["span_id"]: r for r in trace}

    def parent(r: dict) -> dict:
        assert r["parent_span_id"] in by_id, f"{r['name']} has no parent in the trace"
        return by_id[r["parent_span_id"]]

    request = _one(trace, "gateway.request", "gateway")
    assert parent(request) is root
    assert request["attributes"]["pdserve.request_id"] == REQUEST_ID
    assert request["attributes"]["pdserve.output_tokens"] == 8

    # gateway request -> Prefill client -> Prefill server -> PutBlocks client -> kvstore PutBlocks server
    prefill_client = _one(trace, "/pdserve.v1.PrefillWorker/Prefill", "gateway", kind="CLIENT")
    prefill_server = _one(trace, "/pdserve.v1.PrefillWorker/Prefill", "prefill", kind="SERVER")
    put_client = _one(trace, "/pdserve.v1.KVStore/PutBlocks", "prefill", kind="CLIENT")
    # The kvstore also serves the decode worker's write-back of filled blocks: pick by parent.
    put_servers = [r for r in trace
                   if r["name"] == "/pdserve.v1.KVStore/PutBlocks" and r["service"] == "pdserve-kvstore"]
    put_server = next((r for r in put_servers if r["parent_span_id"] == put_client["span_id"]), put_servers[0])
    assert parent(prefill_client) is request
    assert parent(prefill_server) is prefill_client
    assert parent(put_client) is prefill_server
    assert parent(put_server) is put_client

    # gateway request -> Decode client -> Decode server -> GetBlocks client -> kvstore GetBlocks server
    decode_client = _one(trace, "/pdserve.v1.DecodeWorker/Decode", "gateway", kind="CLIENT")
    decode_server = _one(trace, "/pdserve.v1.DecodeWorker/Decode", "decode", kind="SERVER")
    get_client = _one(trace, "/pdserve.v1.KVStore/GetBlocks", "decode", kind="CLIENT")
    get_server = _one(trace, "/pdserve.v1.KVStore/GetBlocks", "kvstore", kind="SERVER")
    assert parent(decode_client) is request
    assert parent(decode_server) is decode_client
    assert parent(get_client) is decode_server
    assert parent(get_server) is get_client
    # decode server -> PutBlocks client (write-back of filled blocks) -> kvstore PutBlocks server
    for write_back in (r for r in put_servers if r is not put_server):
        assert parent(parent(write_back)) is decode_server

    # admission into each engine is a child of the RPC that asked for it
    assert parent(_one(trace, "engine.admit", "decode")) is decode_server
    assert parent(_one(trace, "engine.admit", "prefill")) is prefill_server
    # a child span lies within its parent's time
    for child in (prefill_server, put_server, decode_server, get_server):
        p = parent(child)
        if p["kind"] != "CLIENT":
            assert p["start_ns"] <= child["start_ns"] and child["end_ns"] <= p["end_ns"] + 5_000_000


def test_engine_steps_are_root_spans_linked_to_the_request(spans: list[dict]) -> None:
    root = _root(spans)
    decode_server = _one(spans, "/pdserve.v1.DecodeWorker/Decode", "decode", kind="SERVER")
    prefill_server = _one(spans, "/pdserve.v1.PrefillWorker/Prefill", "prefill", kind="SERVER")
    steps = [r for r in spans if r["name"] == "engine.step"]
    assert all(r["parent_span_id"] is None and r["trace_id"] != root["trace_id"] for r in steps)

    def linked_to(server: dict) -> list[dict]:
        return [r for r in steps if {"trace_id": server["trace_id"], "span_id": server["span_id"]} in r["links"]]

    # prefill samples the first token in one step; decode makes the other 7, one step (and span) each
    assert len(linked_to(prefill_server)) == 1
    decode_steps = linked_to(decode_server)
    assert len(decode_steps) == 7
    assert all(r["service"] == "pdserve-decode" and r["attributes"]["pdserve.batch_size"] == 1 for r in decode_steps)


def test_background_traffic_starts_no_traces(spans: list[dict]) -> None:
    # Health probes, Stats polls and residency reports ran throughout; none may appear.
    names = {r["name"] for r in spans}
    assert not any(n.lstrip("/").startswith("grpc.health") or n.endswith("/Stats") or n.endswith("/ReportResidency")
                   for n in names), names


def test_tracing_off_installs_nothing_and_exports_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(telemetry.TRACES_ENV, raising=False)
    telemetry.reset_for_tests()
    try:
        assert not telemetry.enabled()
        assert telemetry.client_interceptors() == [] and telemetry.server_interceptors() == []
        telemetry.configure("test")  # no provider: the API's no-op tracer stays in place
        span = telemetry.tracer().start_span("x")
        assert not span.is_recording() and not span.get_span_context().is_valid
        # none of the grpc objects pdserve builds carries an interceptor
        from pdserve.grpc_server import grpc_channel

        async def interceptor_lists() -> list:
            # An aio channel belongs to a running loop: build it inside one.
            async with grpc_channel("127.0.0.1:1") as channel:
                return [getattr(channel, f"_{kind}_interceptors") for kind in
                        ("unary_unary", "unary_stream", "stream_unary", "stream_stream")]

        assert not any(asyncio.run(interceptor_lists()))
        monkeypatch.setenv(telemetry.TRACES_ENV, "none")
        telemetry.reset_for_tests()
        assert not telemetry.enabled()
    finally:
        telemetry.reset_for_tests()


def test_tracing_off_engine_makes_no_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine loop with tracing off never asks the tracer for anything."""
    from pdserve.runtime import async_engine

    monkeypatch.delenv(telemetry.TRACES_ENV, raising=False)
    telemetry.reset_for_tests()

    def forbidden(*args, **kwargs):
        raise AssertionError("the tracer was used with tracing off")

    monkeypatch.setattr(telemetry, "tracer", forbidden)
    monkeypatch.setattr(telemetry, "current_span_context", forbidden)
    try:
        engine = _FakeEngine()
        aengine = async_engine.AsyncEngine(engine, batch_window_s=0).start()
        try:
            import asyncio

            async def run() -> int:
                n = 0
                from pdserve.runtime.engine import AddRequest
                from pdserve.runtime.sampling_params import SamplingParams

                async for outs in aengine.generate(AddRequest("r", [1], SamplingParams())):
                    n += len(outs)
                return n
            assert asyncio.run(run()) >= 1
        finally:
            aengine.stop()
    finally:
        telemetry.reset_for_tests()


class _FakeEngine:
    """Just enough of Engine for AsyncEngine: one request, three steps."""

    def __init__(self) -> None:
        from pdserve.runtime.engine import EngineStats

        self.stats = EngineStats(batch_size_counts={})
        self.pending: list[str] = []
        self.left = 0
        self.seqs: dict = {}
        self.scheduler = type("S", (), {"running": [], "waiting": []})()
        self.block_manager = type("B", (), {"num_blocks": 8, "num_free_blocks": 8})()
        self.pins = type("P", (), {"expire": lambda self: 0})()

    def add(self, request) -> None:
        self.pending.append(request.request_id)
        self.left = 3

    def load(self):
        return None

    def has_unfinished(self) -> bool:
        return self.left > 0

    def step(self):
        from pdserve.runtime.engine import StepOutput

        self.left -= 1
        self.stats.steps += 1
        self.stats.batch_size_counts[1] = self.stats.batch_size_counts.get(1, 0) + 1
        return [StepOutput("r", [5], [], self.left == 0, "length" if self.left == 0 else "", 1, 0)]

    def abort(self, rid: str) -> bool:
        return True


def test_failed_request_is_an_error_span(spans: list[dict]) -> None:
    bad = [r for r in spans if r["name"] == "gateway.request" and r["attributes"]["pdserve.request_id"] == "trace-bad"]
    assert len(bad) == 1 and bad[0]["status"] == "ERROR"
    assert bad[0]["attributes"]["pdserve.status"] == "INVALID_ARGUMENT"
    server = next(r for r in spans if r["span_id"] == bad[0]["parent_span_id"])
    # The RPC semantic conventions (the gRPC instrumentation's server spans follow them): a client's
    # mistake (INVALID_ARGUMENT) is no server error, the code says what happened.
    assert server["status"] == "UNSET" and server["attributes"]["rpc.grpc.status_code"] == 3
    good = _one(spans, "gateway.request", "gateway", status="UNSET")
    errors = [(r["service"], r["name"], r["kind"]) for r in spans if r["trace_id"] == good["trace_id"] and r["status"] == "ERROR"]
    assert not errors, errors


# ---- the standard OTEL_* variables, as ProcessConfig reads them --------------------------------

def test_otel_variables_configure_tracing_as_the_sdk_defines_them() -> None:
    from pdserve.grpc_server import ProcessConfig

    def config(**env: str) -> tuple[str, str]:
        c = ProcessConfig.from_env(env)
        return c.traces, c.traces_protocol
    assert config() == ("none", "grpc")  # nothing asked: off (not the SDK's otlp default)
    assert config(OTEL_TRACES_EXPORTER="otlp") == ("otlp", "grpc")
    assert config(OTEL_TRACES_EXPORTER="console, otlp") == ("console,otlp", "grpc")
    assert config(OTEL_TRACES_EXPORTER="otlp", OTEL_SDK_DISABLED="true") == ("none", "grpc")
    assert config(OTEL_TRACES_EXPORTER="console", PDSERVE_TRACES="file:/tmp/x.jsonl")[0] == "file:/tmp/x.jsonl"
    assert config(OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf") == ("none", "http/protobuf")
    assert config(OTEL_EXPORTER_OTLP_PROTOCOL="grpc", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")[1] == \
        "http/protobuf"  # the traces variable first, as the SDK reads them
    for bad in ({"OTEL_TRACES_EXPORTER": "zipkin"}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}):
        with pytest.raises(ValueError):
            ProcessConfig.from_env(bad)


def test_the_resource_follows_otel_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    attrs = telemetry.resource_for("decode").attributes
    assert (attrs["service.name"], attrs["pdserve.service"]) == ("pdserve-decode", "decode")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "chat-prod")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=prod")
    attrs = telemetry.resource_for("decode").attributes
    assert (attrs["service.name"], attrs["pdserve.service"], attrs["deployment.environment"]) == \
        ("chat-prod", "decode", "prod")


def test_a_grpc_request_span_has_the_genai_attributes(spans: list[dict]) -> None:
    request = _one(spans, "gateway.request", "gateway", status="UNSET")
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion"  # a Generate (a Chat would be "chat")
    assert attrs["gen_ai.request.model"] and attrs["gen_ai.response.id"] == REQUEST_ID
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (8, 0.0)
    assert (attrs["gen_ai.usage.output_tokens"], list(attrs["gen_ai.response.finish_reasons"])) == (8, ["length"])
    assert attrs["gen_ai.usage.input_tokens"] > 16  # the prompt fills more than one block
