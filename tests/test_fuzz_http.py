"""Fuzzing the gateway's OpenAI HTTP API: generated /v1/completions and /v1/chat/completions
bodies (known fields with random JSON values and wrong types, unknown fields, invalid JSON, deep
nesting, bodies over the size limit). Every answer is 200 or a documented 4xx with OpenAI error
JSON, never a 5xx; afterwards the stack still serves the reference output and holds no KV."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fuzz_support import FUZZ, assert_still_healthy, expected, stack_fixture  # noqa: F401 (fixture)
from pdserve.ports import free_port

MODEL = "stories260K"
ENDPOINTS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
UNICODE = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """Valid seven times in eight, else anything: bodies get past the first check often enough."""
    return st.integers(0, 7).flatmap(lambda i: valid if i else wild)


# Strings of a JSON body: now and then with a lone UTF-16 surrogate, which json.dumps escapes
# ("\ud800") and Python's json parses into a str that is not Unicode text.
LONE_SURROGATE = st.builds(lambda text, c, at: text[:at] + c + text[at:], UNICODE, st.characters(categories=["Cs"]),
                           st.integers(0, 30))
TEXT = st.integers(0, 31).flatmap(lambda i: UNICODE if i else LONE_SURROGATE)  # one string in 32
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=10)


PROMPT = mostly(st.one_of(st.just("Once upon a time"), TEXT.filter(bool)),
                st.one_of(TEXT, st.lists(TEXT, max_size=3), st.just([1, 2, 3]), JSON))
ROLE = mostly(st.sampled_from(["system", "user", "assistant", "developer"]), JSON)
MESSAGE = mostly(st.fixed_dictionaries({"role": ROLE, "content": mostly(TEXT, JSON)}), JSON)
MESSAGES = mostly(st.lists(MESSAGE, min_size=1, max_size=3), JSON)
SMALL_INT = st.one_of(st.integers(-2, 40), st.sampled_from([2**31, 2**63, 2**64, -2**63]), JSON)
NUMBER = st.one_of(st.floats(-1, 3), st.sampled_from([float("nan"), float("inf"), 1e-40, 1e300]), JSON)
FIELDS = {
    "model": st.integers(0, 9).flatmap(lambda i: st.just(MODEL) if i else JSON),
    "max_tokens": mostly(st.integers(1, 12), SMALL_INT),
    "max_completion_tokens": mostly(st.integers(1, 12), SMALL_INT),
    "temperature": mostly(st.floats(0, 2), NUMBER), "top_p": mostly(st.floats(0.01, 1), NUMBER),
    "top_k": mostly(st.integers(-1, 50), SMALL_INT), "min_p": mostly(st.floats(0, 1), NUMBER),
    "repetition_penalty": mostly(st.floats(0.5, 2), NUMBER), "seed": mostly(st.integers(0, 2**64 - 1), SMALL_INT),
    "n": mostly(st.just(1), SMALL_INT), "stream": mostly(st.booleans(), JSON),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), JSON),
    "stop": mostly(st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=4)), JSON),
    "stop_token_ids": mostly(st.lists(st.integers(0, 600), max_size=3), st.lists(SMALL_INT, max_size=4) | JSON),
    "ignore_eos": mostly(st.booleans(), JSON), "user": mostly(TEXT, JSON),
    "presence_penalty": mostly(st.just(0), NUMBER), "logprobs": mostly(st.none(), JSON),
}


@st.composite
def body(draw, prompt_field: str) -> dict:
    """A request object: the prompt field (mostly), then a random subset of the known fields."""
    out = draw(st.dictionaries(TEXT, JSON, max_size=2))  # unknown fields
    if draw(st.integers(0, 9)):
        out[prompt_field] = draw(MESSAGES if prompt_field == "messages" else PROMPT)
    out["model"] = draw(FIELDS["model"])
    out["max_tokens"] = draw(FIELDS["max_tokens"])  # left out, it fills the context window: slow
    for name, values in FIELDS.items():
        if draw(st.integers(0, 4)) == 0:
            out[name] = draw(values)
    return out


stack = stack_fixture("--http-port", str(free_port()))


def post(stack, path: str, data: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(stack.http_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def assert_documented(status: int, payload: bytes, sent: object) -> None:
    """200 with a completion (or an SSE stream without a server error), or 4xx with error JSON."""
    assert status == 200 or 400 <= status < 500, f"HTTP {status} {payload[:300]!r} for {sent!r}"
    if status != 200:
        error = json.loads(payload)["error"]
        event(f"{status} {error['message'][:30]}")
        assert isinstance(error["message"], str) and error["message"].strip(), payload
    else:
        event("200")
    if status != 200:
        pass
    elif payload.startswith(b"data:"):
        assert b'"server_error"' not in payload, payload[-300:]
        assert payload.rstrip().endswith(b"data: [DONE]"), payload[-300:]
    else:
        assert json.loads(payload)["choices"], payload


@settings(FUZZ, max_examples=70)
@given(path=st.sampled_from(sorted(ENDPOINTS)), data=st.data())
def test_json_bodies(stack, path, data):
    sent = data.draw(body(ENDPOINTS[path]))
    raw = json.dumps(sent).encode()  # Python's json writes NaN and Infinity, as some clients do
    assert_documented(*post(stack, path, raw), sent)


RAW = st.one_of(st.binary(max_size=200), UNICODE.map(str.encode), st.just(b""), st.just(b"null"),
                st.integers(1, 200000).map(lambda n: b"[" * n), st.integers(1, 200000).map(lambda n: b'{"a":' * n),
                st.just(b'{"model": "stories260K", "prompt": "\xff\xfe"}'), st.just(b" " * (9 << 20)))


@settings(FUZZ, max_examples=40)
@given(path=st.sampled_from(sorted(ENDPOINTS)), raw=RAW)
def test_raw_bodies(stack, path, raw):
    assert_documented(*post(stack, path, raw), raw[:100])


def test_deeply_nested_json_is_a_400(stack):
    # Found by fuzzing: json.loads raised RecursionError, answered 500.
    status, payload = post(stack, "/v1/completions", b"[" * 100000)
    assert status == 400, payload
    assert "nested too deeply" in json.loads(payload)["error"]["message"]


LONE_SURROGATES = [  # (route, body as JSON text, the param the 400 names)
    ("/v1/chat/completions",
     '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "\\udfff Once"}', "prompt"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "Once", "stop": ["a", "\\uD83D"]}',
     "stop[1]"),
    ("/v1/completions", '{"model": "%s", "max_tokens": 2, "prompt": "Once", "\\ud800": 1}', None),
]


@pytest.mark.parametrize("path, text, param", LONE_SURROGATES, ids=["chat", "prompt", "stop", "key"])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(stack, path, text, param):
    # Found from outside: a chat message holding "\ud800" answered 500 (the tokenizer's TypeError).
    status, payload = post(stack, path, (text % MODEL).encode())
    error = json.loads(payload)["error"]
    assert status == 400 and "lone UTF-16 surrogate" in error["message"] and error["param"] == param, payload


def test_a_surrogate_pair_is_the_character_it_spells(stack):
    body = '{"model": "%s", "max_tokens": 2, "temperature": 0, "prompt": "Once \\ud83d\\ude42"}' % MODEL
    status, payload = post(stack, "/v1/completions", body.encode())
    plain = json.dumps({"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt": "Once \U0001F642"})
    assert status == 200 and json.loads(payload)["choices"][0]["text"] == json.loads(
        post(stack, "/v1/completions", plain.encode())[1])["choices"][0]["text"], payload


@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("stop_token_ids", [2**40])])
def test_values_beyond_int32_name_their_field(stack, field, value):
    # Found by fuzzing: protobuf's "Value out of range: 9223372036854775808" came back, naming no field.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, field: value}
    status, payload = post(stack, "/v1/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(payload)["error"]["param"] == field, payload


def test_stack_healthy_after_fuzzing(stack, expected):
    assert_still_healthy(stack, expected)
