"""The HTTP API around the completions (issue 19): CORS, /tokenize /detokenize /version, X-Request-Id on
every response, W3C traceparent, and what `pdserve up`'s new flags do to a running stack.

One stack for the module, started as a person would (`up` flags: --port, --served-model-name,
--max-model-len, --api-key next to --api-keys-file, --allowed-origins; tracing to a JSON-lines file).
References: transformers' tokenizer of the same GGUF vocabulary, the gRPC API's greedy answer, the
pyproject version, the W3C ids the test sends. The browser tests load a page from a second aiohttp
server (another origin) in headless chromium: it streams a chat completion from the gateway with an
Authorization header when its origin is allowed, and the browser blocks it when not. Two in-process
gateways (no workers needed) show CORS off by default and `*`, and X-Request-Id on 413/503/405.
"""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from browser import Browser, needs_chromium, open_page
from gateway import server as gateway_server
from gateway.config import GatewayConfig
from gateway.request_limits import RequestLimits
from hf_reference import load_hf_gguf_tokenizer
from pdserve import telemetry
from pdserve.ports import free_port
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "tests" / "fixtures" / "stories260K" / "stories260K.gguf"
NAME = "tiny-stories"  # --served-model-name
MAX_LEN = 96  # --max-model-len (the model's window is 2048)
FLAG_KEY = "sk-surface-flag-key-1"  # --api-key
FILE_KEY = "sk-surface-file-key-2"  # in --api-keys-file, as is the limited one
LIMITED_KEY = "sk-surface-limited-3"
AUTH = {"Authorization": f"Bearer {FLAG_KEY}"}
PAGE_PORT, OTHER_PAGE_PORT = free_port(), free_port()
ALLOWED = f"http://127.0.0.1:{PAGE_PORT}"  # --allowed-origins
OTHER = f"http://127.0.0.1:{OTHER_PAGE_PORT}"  # an origin not allowed
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def spans_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("surface") / "spans.jsonl"


@pytest.fixture(scope="module")
def stack(spans_path: Path, tmp_path_factory: pytest.TempPathFactory):
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"{FILE_KEY} name=file\n{LIMITED_KEY} name=limited rate=1/h burst=1\n")
    s = start_stack(1, 1, "--port", str(free_port()), "--served-model-name", NAME, "--max-model-len", str(MAX_LEN),
                    "--api-key", FLAG_KEY, "--api-keys-file", str(keys), "--allowed-origins", ALLOWED,
                    env={telemetry.TRACES_ENV: f"file:{spans_path}"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return load_hf_gguf_tokenizer(STORIES, tmp_path_factory.mktemp("hf"))


def call(stack, method: str, path: str, body: object = None, headers: dict | None = None,
         raw: bytes | None = None) -> tuple[int, CIMultiDict, object]:
    """(status, headers, JSON or text) of one request to the stack's HTTP API."""
    async def go():
        async with aiohttp.ClientSession() as session:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            async with session.request(method, stack.http_url + path, data=data, headers={
                    **({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}) as r:
                text = await r.text()
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError:
                    parsed = text
                return r.status, CIMultiDict(r.headers), parsed
    return asyncio.run(go())


def grpc_chat_text(stack, messages: list[dict], max_tokens: int) -> str:
    req = gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                                  sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True))
    stub = stack.gateway_stub()
    return "".join(c.text for c in stub.Chat(req, timeout=60, metadata=(("authorization", f"Bearer {FLAG_KEY}"),)))


# ---- the flags of `pdserve up`, on the running stack ---------------------------------------------------

def test_served_model_name_and_max_model_len(stack, hf_tokenizer) -> None:
    status, _, models = call(stack, "GET", "/v1/models", headers=AUTH)
    assert status == 200 and [(m["id"], m["max_model_len"]) for m in models["data"]] == [(NAME, MAX_LEN)]
    assert call(stack, "POST", "/v1/completions", {"model": "stories260K", "prompt": PROMPT}, AUTH)[0] == 404
    # Without max_tokens a completion takes all the room the capped window leaves (vLLM's and OpenAI's rule).
    status, _, done = call(stack, "POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "temperature": 0,
                                                              "ignore_eos": True}, AUTH)
    assert status == 200, done
    assert done["usage"]["prompt_tokens"] == len(hf_tokenizer.encode(PROMPT))
    assert done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"] == MAX_LEN
    status, _, err = call(stack, "POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_LEN},
                          AUTH)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert str(MAX_LEN) in err["error"]["message"]


def test_api_keys_from_the_flag_and_the_file(stack) -> None:
    for path in ("/v1/models", "/version"):
        assert call(stack, "GET", path)[0] == 401
        assert call(stack, "GET", path, headers={"Authorization": "Bearer sk-wrong"})[0] == 401
        assert call(stack, "GET", path, headers=AUTH)[0] == 200
        assert call(stack, "GET", path, headers={"Authorization": f"Bearer {FILE_KEY}"})[0] == 200
    assert call(stack, "POST", "/tokenize", {"prompt": PROMPT})[0] == 401
    assert call(stack, "GET", "/health")[0] == 200  # open, as before


# ---- /tokenize, /detokenize, /version ------------------------------------------------------------------

def test_tokenize_counts_as_transformers_and_the_completions_do(stack, hf_tokenizer) -> None:
    status, _, tok = call(stack, "POST", "/tokenize", {"model": NAME, "prompt": PROMPT}, AUTH)
    assert status == 200 and tok == {"count": len(tok["tokens"]), "max_model_len": MAX_LEN,
                                     "tokens": hf_tokenizer.encode(PROMPT)}
    assert call(stack, "POST", "/tokenize", {"prompt": PROMPT}, AUTH)[2] == tok  # model defaults to the served one
    bare = call(stack, "POST", "/tokenize", {"model": NAME, "prompt": PROMPT, "add_special_tokens": False}, AUTH)[2]
    assert bare["tokens"] == hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    # A chat counts as the chat completion of the same messages does.
    status, _, chat_tok = call(stack, "POST", "/tokenize", {"model": NAME, "messages": MESSAGES}, AUTH)
    status2, _, chat = call(stack, "POST", "/v1/chat/completions", {"model": NAME, "messages": MESSAGES,
                                                                    "max_tokens": 1}, AUTH)
    assert status == status2 == 200 and chat_tok["count"] == chat["usage"]["prompt_tokens"] > 5


def test_detokenize_decodes_as_transformers_does(stack, hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("Once upon a time, Lily saw a big dog.")
    status, _, body = call(stack, "POST", "/detokenize", {"model": NAME, "tokens": ids}, AUTH)
    assert status == 200 and body == {"prompt": hf_tokenizer.decode(ids)}
    vocab = len(hf_tokenizer)
    for bad, param in (([5, vocab], "tokens[1]"), ([-1], "tokens[0]"), ([1.5], "tokens[0]"), ("1 2", "tokens")):
        status, _, err = call(stack, "POST", "/detokenize", {"model": NAME, "tokens": bad}, AUTH)
        assert status == 400 and err["error"]["param"] == param, (bad, err)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": NAME}, 400, "messages"),
    ("/tokenize", {"model": NAME, "prompt": PROMPT, "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("/tokenize", {"model": NAME, "messages": MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ("/tokenize", {"model": NAME, "prompt": 7}, 400, "prompt"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model"),
])
def test_utility_errors_name_the_field(stack, path: str, body: dict, status: int, param: str) -> None:
    got, _, err = call(stack, "POST", path, body, AUTH)
    assert got == status and err["error"]["param"] == param, err


def test_version_is_the_package_version(stack) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    status, _, body = call(stack, "GET", "/version", headers=AUTH)
    assert status == 200 and body == {"version": version}


# ---- X-Request-Id ---------------------------------------------------------------------------------------

def test_every_response_has_a_request_id(stack) -> None:
    answers = {
        200: call(stack, "GET", "/version", headers=AUTH),
        401: call(stack, "GET", "/version"),
        404: call(stack, "GET", "/v2/nothing", headers=AUTH),
        400: call(stack, "POST", "/tokenize", raw=b"{not json", headers=AUTH),
        405: call(stack, "GET", "/tokenize", headers=AUTH),
    }
    limited = {"Authorization": f"Bearer {LIMITED_KEY}"}
    assert call(stack, "GET", "/version", headers=limited)[0] == 200  # its burst of one
    answers[429] = call(stack, "GET", "/version", headers=limited)
    for status, (got, headers, _) in answers.items():
        assert got == status and GENERATED_ID.fullmatch(headers["X-Request-Id"]), (status, headers)
    assert len({h["X-Request-Id"] for _, h, _ in answers.values()}) == len(answers)  # one per response


def test_a_client_request_id_is_echoed_errors_included(stack) -> None:
    for path, body, status in (("/tokenize", {"model": NAME, "prompt": PROMPT}, 200), ("/tokenize", {}, 400),
                               ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404)):
        got, headers, _ = call(stack, "POST", path, body, {**AUTH, "X-Request-Id": "client-id-7"})
        assert (got, headers["X-Request-Id"]) == (status, "client-id-7")
    # A completion keeps the id the completions handler gives it: the client's, else its response id's.
    _, headers, done = call(stack, "POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2},
                            {**AUTH, "X-Request-Id": "client-id-8"})
    assert headers["X-Request-Id"] == "client-id-8" and done["id"] == "cmpl-client-id-8"
    _, headers, done = call(stack, "POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 2}, AUTH)
    assert done["id"] == "cmpl-" + headers["X-Request-Id"]
    # One over --max-id-chars (256) is not echoed: the response gets an id of the gateway's.
    _, headers, _ = call(stack, "GET", "/version", headers={**AUTH, "X-Request-Id": "x" * 257})
    assert GENERATED_ID.fullmatch(headers["X-Request-Id"])


# ---- CORS, header by header -----------------------------------------------------------------------------

def test_cors_preflight_and_responses(stack) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = call(stack, "OPTIONS", "/v1/chat/completions", headers={"Origin": ALLOWED, **preflight})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ALLOWED  # no key needed, no 401
    allowed_headers = {h.strip().lower() for h in headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-request-id"} <= allowed_headers
    assert "POST" in headers["Access-Control-Allow-Methods"] and int(headers["Access-Control-Max-Age"]) > 0
    status, headers, err = call(stack, "OPTIONS", "/v1/chat/completions", headers={"Origin": OTHER, **preflight})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert "--allowed-origins" in err["error"]["message"] and OTHER in err["error"]["message"]
    # A stream to an allowed origin carries the headers (set before its head is sent); others get none.
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    status, headers, text = call(stack, "POST", "/v1/chat/completions", body, {**AUTH, "Origin": ALLOWED})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream") and "[DONE]" in text
    assert headers["Access-Control-Allow-Origin"] == ALLOWED and "Origin" in headers["Vary"]
    assert "X-Request-Id" in headers["Access-Control-Expose-Headers"]
    for origin in (OTHER, None):
        sent = {**AUTH, **({"Origin": origin} if origin else {})}
        status, headers, _ = call(stack, "GET", "/v1/models", headers=sent)
        assert status == 200 and "Access-Control-Allow-Origin" not in headers and "Origin" in headers["Vary"]
    status, headers, _ = call(stack, "GET", "/v1/models", headers={"Origin": ALLOWED})  # a 401 is readable too
    assert status == 401 and headers["Access-Control-Allow-Origin"] == ALLOWED


def test_cors_is_off_by_default_and_star_allows_any_origin_in_process() -> None:
    asyncio.run(_in_process_gateways())


async def _in_process_gateways() -> None:
    dead = f"127.0.0.1:{free_port()}"
    origin = "http://anywhere.example:5173"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    for settings, allowed in ((GatewayConfig(limits=RequestLimits(max_request_bytes=1024)), False),
                              (GatewayConfig(allowed_origins=("*",)), True)):
        server, _ = await gateway_server.serve("127.0.0.1:0", dead, dead, None, str(STORIES), http_bind="127.0.0.1:0",
                                               settings=settings)
        base = f"http://127.0.0.1:{gateway_server.http_server(server).port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.options(base + "/v1/chat/completions", headers=preflight) as r:
                    cors_headers = [h for h in r.headers if h.lower().startswith("access-control-")]
                    if allowed:
                        assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == origin
                    else:  # as before this issue: no preflight answer, no CORS header at all
                        assert r.status == 405 and cors_headers == [] and "Vary" not in r.headers
                    assert GENERATED_ID.fullmatch(r.headers["X-Request-Id"])
                if allowed:
                    continue
                statuses = {}
                async with session.post(base + "/tokenize", data=b"x" * 4096, headers={"X-Request-Id": "big-1"}) as r:
                    statuses[r.status] = r.headers["X-Request-Id"]
                async with session.post(base + "/v1/completions", json={"model": "stories260K", "prompt": "a"},
                                        headers={"X-Request-Id": "no-workers-1"}) as r:
                    statuses[r.status] = r.headers["X-Request-Id"]
                assert statuses == {413: "big-1", 503: "no-workers-1"}
        finally:
            await gateway_server.stop(server, grace_s=1)


# ---- traceparent ----------------------------------------------------------------------------------------

def _spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_traceparent_starts_the_request_trace(stack, spans_path: Path) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {**AUTH, "traceparent": f"00-{trace_id}-{parent_id}-01"}
    status, _, _ = call(stack, "POST", "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 3}, headers)
    assert status == 200
    other_trace = "0af7651916cd43dd8448eb211c80319c"
    call(stack, "POST", "/tokenize", {"prompt": PROMPT}, {**AUTH, "traceparent": f"00-{other_trace}-{parent_id}-01"})

    def finished() -> list[dict] | None:
        rows = _spans(spans_path)
        ours = [r for r in rows if r["trace_id"] in (trace_id, other_trace)]
        names = {r["name"] for r in ours}
        return ours if {"POST /v1/completions", "gateway.request", "POST /tokenize"} <= names else None
    rows = wait_until(finished, timeout_s=30)
    assert rows, [r["name"] for r in _spans(spans_path)]
    http = next(r for r in rows if r["name"] == "POST /v1/completions")
    assert (http["trace_id"], http["parent_span_id"], http["kind"]) == (trace_id, parent_id, "SERVER")
    assert http["attributes"]["http.response.status_code"] == 200
    request = next(r for r in rows if r["name"] == "gateway.request")
    assert request["trace_id"] == trace_id and request["parent_span_id"] == http["span_id"]
    # The trace goes on to the workers, as a gRPC request's does.
    assert wait_until(lambda: {"pdserve-prefill", "pdserve-decode"} <= {
        r["service"] for r in _spans(spans_path) if r["trace_id"] == trace_id}, timeout_s=30)
    tokenize = next(r for r in rows if r["name"] == "POST /tokenize")
    assert (tokenize["trace_id"], tokenize["parent_span_id"]) == (other_trace, parent_id)


# ---- a real page on another origin, in chromium ------------------------------------------------------------

PAGE = """<!doctype html><meta charset="utf-8"><title>cors test</title><script>
async function streamChat(url, key, body) {
  try {
    const r = await fetch(url, {method: "POST", body: JSON.stringify(body),
                                headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"}});
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let raw = "", text = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      raw += decoder.decode(value, {stream: true});
    }
    for (const line of raw.split("\\n")) {
      if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
      text += JSON.parse(line.slice(6)).choices[0].delta.content || "";
    }
    return {ok: true, status: r.status, text, done: raw.includes("data: [DONE]"),
            requestId: r.headers.get("X-Request-Id")};
  } catch (e) { return {ok: false, error: String(e)}; }
}
</script><p>page</p>"""


async def _page_server(port: int) -> web.AppRunner:
    app = web.Application()

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")
    app.router.add_get("/", page)
    app.router.add_get("/health", page)  # open_page visits it first
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


async def _fetch_from_page(browser: Browser, page_port: int, gateway: str) -> dict:
    runner = await _page_server(page_port)
    try:
        async with open_page(browser, f"http://127.0.0.1:{page_port}") as cdp:
            await cdp.wait_for("typeof streamChat === 'function'")
            body = {"model": NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            args = ", ".join(json.dumps(a) for a in (gateway + "/v1/chat/completions", FLAG_KEY, body))
            return await cdp.js(f"streamChat({args})")
    finally:
        await runner.cleanup()


def _refused_preflights(stack) -> float:
    """HTTP 403s the gateway answered (only refused preflights get one)."""
    text = call(stack, "GET", "/metrics", headers=AUTH)[2]
    return sum(float(v) for v in re.findall(r'^pdserve_gateway_http_requests_total\{[^}]*status="403"[^}]*\} (\S+)$',
                                            text, re.MULTILINE))


@needs_chromium
def test_a_page_on_an_allowed_origin_streams_a_chat_completion(stack, browser) -> None:
    result = asyncio.run(_fetch_from_page(browser, PAGE_PORT, stack.http_url))
    assert result["ok"] and result["status"] == 200 and result["done"], result
    assert result["text"] == grpc_chat_text(stack, MESSAGES, 12)  # the same greedy answer as over gRPC
    assert result["requestId"]  # exposed to the page's script (Access-Control-Expose-Headers)


@needs_chromium
def test_the_browser_blocks_a_page_on_another_origin(stack, browser) -> None:
    before = _refused_preflights(stack)
    result = asyncio.run(_fetch_from_page(browser, OTHER_PAGE_PORT, stack.http_url))
    assert not result["ok"] and "Failed to fetch" in result["error"], result
    assert _refused_preflights(stack) == before + 1  # it was our 403 to the preflight that stopped it
