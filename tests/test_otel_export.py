"""OpenTelemetry export as the SDK's variables configure it, into real OTLP receivers, and each
service's Prometheus /metrics, from one real stack (stories260K; kvstore, prefill, decode, gateway,
each its own process).

The stack is configured only through OTEL_* variables (no PDSERVE_TRACES): the gateway and the
prefill worker export OTLP/HTTP (http/protobuf) to an HTTP receiver here, the kvstore and the decode
worker OTLP/gRPC to a gRPC receiver here, so one request's trace arrives half over each protocol and
is checked whole: one trace id from the client's traceparent through the gateway's HTTP span to
prefill, kvstore and decode, each span parented as the request travelled, and the gateway's request
span carrying the GenAI semantic conventions' attributes. Every process serves /metrics on its own
port: each must hold only its own service's families."""

from __future__ import annotations

import json
import os
import secrets
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve import telemetry
from waiting import wait_until

# Longer than one 16-token block, so prefill puts blocks and decode gets them.
PROMPT = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog."
MAX_TOKENS = 8


class Collected:
    """Spans an OTLP receiver got, flattened as telemetry.span_record writes them, with the protocol."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, protocol: str) -> None:
        rows = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    rows.append({
                        "protocol": protocol, "service": resource.get("pdserve.service"),
                        "service_name": resource.get("service.name"), "name": span.name,
                        "kind": span.kind, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex() or None,
                        "attributes": {kv.key: _value(kv.value) for kv in span.attributes}})
        with self._lock:
            self.rows.extend(rows)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.rows)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _http_receiver(collected: Collected) -> ThreadingHTTPServer:
    """POST /v1/traces, as an OpenTelemetry collector's OTLP/HTTP receiver answers it."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces" or self.headers["Content-Type"] != "application/x-protobuf":
                self.send_error(404)
                return
            collected.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body), "http/protobuf")
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _grpc_receiver(collected: Collected) -> tuple[grpc.Server, int]:
    """opentelemetry.proto.collector.trace.v1.TraceService/Export, as a collector's OTLP/gRPC receiver."""
    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the proto's name
            collected.add(request, "grpc")
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _start_stack(http_endpoint: str, grpc_endpoint: str):
    """start_stack's stack with each child's own OTEL_* and metrics port."""
    from pdserve.cli import build_parser
    from pdserve.commands.up import plan
    from pdserve.ports import free_port
    from pdserve.stack import start_planned

    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "1", "--grpc-port", str(free_port()),
                                      "--threads", "1", "--http-port", str(free_port()), "--no-internal-token"])
    workers, gateway = plan(args)
    common = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "50",
              "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    over = {"http/protobuf": {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                              "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": http_endpoint},
            "grpc": {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": grpc_endpoint}}

    def configured(spec):
        protocol = "http/protobuf" if spec.name in ("gateway", "prefill-0") else "grpc"
        env = {**common, **over[protocol], "PDSERVE_METRICS_PORT": str(free_port())}
        return replace(spec, env=(*spec.env, *env.items()))
    workers, gateway = [configured(w) for w in workers], configured(gateway)
    return start_planned(workers, gateway, args)


@pytest.fixture(scope="module")
def run() -> Iterator[dict]:
    """The stack after one traced chat completion: its spans, the response, the client's span, the
    metrics of every process before and after the request."""
    assert telemetry.TRACES_ENV not in os.environ, "PDSERVE_TRACES would win over the OTEL_* variables"
    collected = Collected()
    http_server = _http_receiver(collected)
    grpc_server, grpc_port = _grpc_receiver(collected)
    stack = _start_stack(f"http://127.0.0.1:{http_server.server_port}/v1/traces", f"http://127.0.0.1:{grpc_port}")
    try:
        ports = {c.spec.name: int(dict(c.spec.env)["PDSERVE_METRICS_PORT"]) for c in [*stack.workers, stack.gateway]}
        before = {name: _scrape(port) for name, port in ports.items()}
        models = json.loads(urllib.request.urlopen(f"{stack.http_url}/v1/models", timeout=30).read())
        model = models["data"][0]["id"]
        trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"{stack.http_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "traceparent": f"00-{trace_id}-{parent_id}-01"})
        response = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert response["usage"]["completion_tokens"] == MAX_TOKENS

        def complete() -> list[dict]:
            rows = [r for r in collected.snapshot() if r["trace_id"] == trace_id]
            seen = {(r["service"], r["name"]) for r in rows}
            # Every span the tests below look at: each process exports in its own batches, and the
            # Decode spans (client and server) end only after the gateway cancels the finished stream.
            want = {("gateway", "gateway.request"), ("gateway", "POST /v1/chat/completions"),
                    ("gateway", "/pdserve.v1.PrefillWorker/Prefill"), ("gateway", "/pdserve.v1.DecodeWorker/Decode"),
                    ("prefill", "/pdserve.v1.PrefillWorker/Prefill"), ("prefill", "/pdserve.v1.KVStore/PutBlocks"),
                    ("decode", "/pdserve.v1.DecodeWorker/Decode"), ("decode", "/pdserve.v1.KVStore/GetBlocks"),
                    ("kvstore", "/pdserve.v1.KVStore/GetBlocks"), ("kvstore", "/pdserve.v1.KVStore/PutBlocks")}
            return rows if want <= seen else []
        rows = wait_until(complete, timeout_s=30)
        after = {name: _scrape(port) for name, port in ports.items()}
        yield {"spans": rows, "response": response, "model": model, "trace_id": trace_id, "parent_id": parent_id,
               "before": before, "after": after}
    finally:
        stack.stop()
        http_server.shutdown()
        grpc_server.stop(0)


def _scrape(port: int) -> dict[str, dict[tuple, float]]:
    """{family: {(sample name, sorted labels): value}} of one process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for f in text_string_to_metric_families(text)}


def _one(rows: list[dict], service: str, name: str, kind: int) -> dict:
    found = [r for r in rows if r["service"] == service and r["name"] == name and r["kind"] == kind]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans in " + \
        ", ".join(f"{r['service']}:{r['name']}" for r in rows)
    return found[0]


SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


def test_one_trace_from_the_client_through_all_four_services_over_both_protocols(run: dict) -> None:
    rows = run["spans"]
    by_id = {r["span_id"]: r for r in rows}

    def parent(r: dict) -> dict:
        assert r["parent_span_id"] in by_id, f"{r['service']} {r['name']} has no parent in the trace"
        return by_id[r["parent_span_id"]]

    assert {r["service"] for r in rows} == {"gateway", "prefill", "kvstore", "decode"}
    assert {r["protocol"] for r in rows if r["service"] in ("gateway", "prefill")} == {"http/protobuf"}
    assert {r["protocol"] for r in rows if r["service"] in ("kvstore", "decode")} == {"grpc"}
    assert {r["service_name"] for r in rows} == {"pdserve-gateway", "pdserve-prefill", "pdserve-kvstore",
                                                 "pdserve-decode"}  # no OTEL_SERVICE_NAME: ours
    http = _one(rows, "gateway", "POST /v1/chat/completions", SERVER)
    assert http["parent_span_id"] == run["parent_id"]  # the client's traceparent continued
    assert http["attributes"]["http.response.status_code"] == 200
    request = next(r for r in rows if r["name"] == "gateway.request")
    assert parent(request) is http
    prefill_client = _one(rows, "gateway", "/pdserve.v1.PrefillWorker/Prefill", CLIENT)
    prefill_server = _one(rows, "prefill", "/pdserve.v1.PrefillWorker/Prefill", SERVER)
    put_client = _one(rows, "prefill", "/pdserve.v1.KVStore/PutBlocks", CLIENT)
    put_server = next(r for r in rows if r["service"] == "kvstore" and r["parent_span_id"] == put_client["span_id"])
    assert (parent(prefill_client), parent(prefill_server), parent(put_client), parent(put_server)) == \
        (request, prefill_client, prefill_server, put_client)
    decode_client = _one(rows, "gateway", "/pdserve.v1.DecodeWorker/Decode", CLIENT)
    decode_server = _one(rows, "decode", "/pdserve.v1.DecodeWorker/Decode", SERVER)
    get_client = _one(rows, "decode", "/pdserve.v1.KVStore/GetBlocks", CLIENT)
    get_server = _one(rows, "kvstore", "/pdserve.v1.KVStore/GetBlocks", SERVER)
    assert (parent(decode_client), parent(decode_server), parent(get_client), parent(get_server)) == \
        (request, decode_client, decode_server, get_client)


def test_the_request_span_has_the_genai_attributes(run: dict) -> None:
    request = next(r for r in run["spans"] if r["name"] == "gateway.request")
    usage = run["response"]["usage"]
    expected = {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": run["model"],
        "gen_ai.request.max_tokens": MAX_TOKENS, "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
        "gen_ai.response.id": run["response"]["id"], "gen_ai.response.finish_reasons": ["length"],
        "gen_ai.usage.input_tokens": usage["prompt_tokens"], "gen_ai.usage.output_tokens": MAX_TOKENS}
    got = {k: request["attributes"].get(k) for k in expected}
    assert got == expected


GATEWAY_ONLY = {"pdserve_requests", "pdserve_ttft_seconds", "pdserve_inter_token_latency_seconds",
                "pdserve_e2e_seconds", "pdserve_slo_breach", "pdserve_gateway_http_requests", "pdserve_prompt_tokens"}
WORKER_ONLY = {"pdserve_engine_step_seconds", "pdserve_engine_running_seqs", "pdserve_kv_cache_usage_ratio",
               "pdserve_engine_preemptions", "pdserve_prefix_cache_queries", "pdserve_kv_transfer_bytes"}
KVSTORE_ONLY = {"pdserve_kvstore_blocks", "pdserve_kvstore_evictions"}


def test_each_service_serves_only_its_own_metrics(run: dict) -> None:
    for name, families in run["after"].items():
        own = {"gateway": GATEWAY_ONLY, "kvstore": KVSTORE_ONLY}.get(name, WORKER_ONLY)
        others = (GATEWAY_ONLY | WORKER_ONLY | KVSTORE_ONLY) - own
        assert own <= set(families), (name, own - set(families))
        assert not others & set(families), (name, others & set(families))


def _sum(scrape: dict, family: str, sample: str, **labels: str) -> float:
    return sum(v for (name, lbls), v in scrape.get(family, {}).items()
               if name == sample and all(dict(lbls).get(k) == x for k, x in labels.items()))


def test_the_new_metrics_move_when_a_request_runs(run: dict) -> None:
    before, after, model = run["before"], run["after"], run["model"]

    def moved(process: str, family: str, sample: str, **labels: str) -> float:
        return _sum(after[process], family, sample, **labels) - _sum(before[process], family, sample, **labels)
    assert moved("gateway", "pdserve_requests", "pdserve_requests_total", status="OK", model_name=model) == 1
    # 8 tokens: the first from prefill, 7 gaps after it
    assert moved("gateway", "pdserve_inter_token_latency_seconds", "pdserve_inter_token_latency_seconds_count",
                 model_name=model) == MAX_TOKENS - 1
    assert moved("gateway", "pdserve_ttft_seconds", "pdserve_ttft_seconds_count", model_name=model) == 1
    for worker in ("prefill-0", "decode-0"):
        usage = _sum(after[worker], "pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_usage_ratio")
        assert 0 <= usage <= 1
        assert moved(worker, "pdserve_engine_queue_seconds", "pdserve_engine_queue_seconds_count") == 1
    prompt_tokens = run["response"]["usage"]["prompt_tokens"]
    assert moved("prefill-0", "pdserve_prefix_cache_queries", "pdserve_prefix_cache_queries_total") == prompt_tokens
