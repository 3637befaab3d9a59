"""The OpenAI request and response fields of the HTTP API, each through the official `openai` SDK
against one real stack (1 prefill, 1 decode, kvstore, HTTP), streamed and not.

References: `jsonschema` (structured output), the in-process engine (logprobs, penalties: the same
weights and sampler in this process), the gRPC API (the seeds of n choices, echo, batched and
token-id prompts: the same request through service.py), the model's tokenizer (token counts in
the over-long prompt's message). The structured-output and penalty rows pass once the workers
enforce `SamplingParams.structured` / the penalties / logit_bias (until then the stack ignores them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import urllib.request

import jsonschema
import openai
import pytest
import torch

from conftest import STORIES_GGUF
from gateway.prompts import tokenize_chat
from pdserve.ports import free_port
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2
from waiting import wait_until

MODEL = "stories260K"
PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--http-port", str(free_port()))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def checkpoint():
    torch.set_num_threads(1)  # a tiny model: more threads only fight the stack's processes for the cores
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.from_checkpoint(checkpoint)


def grpc_generate(stack, prompt: str, max_tokens: int, **sampling) -> tuple[str, int]:
    """(text, prompt tokens) of the gRPC API's answer to the same request."""
    req = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                        **sampling))
    chunks = list(stack.gateway_stub().Generate(req, timeout=60))
    return "".join(c.text for c in chunks), chunks[-1].usage.prompt_tokens


def collect_chat(stream) -> tuple[dict[int, str], dict[int, list], dict[int, str], list]:
    """A streamed chat: (text, logprob entries, finish reason) by choice index, and the chunks."""
    chunks = list(stream)
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    reasons: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            logprobs.setdefault(ch.index, []).extend(ch.logprobs.content if ch.logprobs else [])
            if ch.finish_reason:
                assert ch.index not in reasons  # one finish per choice
                reasons[ch.index] = ch.finish_reason
    return texts, logprobs, reasons, chunks


def collect_completion(stream) -> tuple[dict[int, str], dict[int, dict], list]:
    chunks = list(stream)
    texts: dict[int, str] = {}
    logprobs: dict[int, dict] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                lp = logprobs.setdefault(ch.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                    "text_offset": []})
                for key in lp:
                    lp[key].extend(getattr(ch.logprobs, key))
    return texts, logprobs, chunks


def bad_request(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    return err.value


# ---- structured output ------------------------------------------------------------------------

def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    _obj({"name": {"type": "string", "maxLength": 8}}),
    _obj({"age": SMALL_INT}),
    _obj({"happy": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}}),
    _obj({"pet": _obj({"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 4}})}),
    _obj({"answer": {"const": "yes"}}),
    _obj({"word": {"type": "string", "pattern": "^[a-z]{1,5}$"}}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    _obj({"nothing": {"type": "null"}, "flag": {"type": "boolean"}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2}}),
    _obj({"ok": {"type": "boolean"}, "count": SMALL_INT, "size": {"enum": ["S", "M", "L"]}}),
    {"enum": ["alpha", "beta"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    _obj({"code": {"type": "string", "minLength": 1, "maxLength": 4}}),
    _obj({"id": SMALL_INT, "note": {"type": "string", "maxLength": 6}}, required=["id"]),
    {"$defs": {"point": _obj({"x": SMALL_INT, "y": SMALL_INT})}, **_obj({"p": {"$ref": "#/$defs/point"}})},
    {"type": "array", "prefixItems": [SMALL_INT, {"type": "boolean"}], "items": False, "minItems": 2},
    _obj({"people": {"type": "array", "maxItems": 2, "items": _obj({"n": {"type": "string", "maxLength": 4}})}}),
    _obj({"level": {"oneOf": [{"const": "low"}, {"const": "high"}]}, "on": {"type": "boolean"}}),
]
STRUCTURED_TOKENS = 80  # the vocabulary is 512 tokens: JSON costs about a token a character


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_response_format_json_schema_output_validates(client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=STRUCTURED_TOKENS,
                                           temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    texts, _, _, _ = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=STRUCTURED_TOKENS, temperature=0.8, seed=3, response_format=fmt,
        stream=True))
    jsonschema.validate(json.loads(texts[0]), schema)


CONSTRAINED = [  # (extra body fields, what the output must satisfy)
    ({"guided_json": SCHEMAS[3]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3]) is None),
    ({"guided_json": json.dumps(SCHEMAS[1])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1]) is None),
    ({"guided_regex": "[a-z]{2,6}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{2,6}-[0-9]{2}", t) is not None),
    ({"guided_choice": ["happy", "sad"]}, lambda t: t in ("happy", "sad")),
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t) is not None),
]


@pytest.mark.parametrize(("extra", "holds"), CONSTRAINED, ids=[next(iter(e)) + str(i) for i, (e, _) in
                                                               enumerate(CONSTRAINED)])
def test_vllm_guided_fields_constrain_chat_and_completions(client, extra, holds):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=STRUCTURED_TOKENS, temperature=0,
                                           extra_body=extra)
    assert holds(whole.choices[0].message.content), whole.choices[0].message.content
    texts, _, _ = collect_completion(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=STRUCTURED_TOKENS, temperature=0, stream=True, extra_body=extra))
    assert holds(texts[0]), texts[0]


def test_json_object_starts_an_object_and_parses_when_complete(client):
    """Any JSON object: a story model fills its first string until max_tokens, so the output is
    checked as far as it goes (a whole object when it stopped)."""
    fmt = {"type": "json_object"}
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                           response_format=fmt)
    texts, _, reasons, _ = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, response_format=fmt, stream=True))
    for text, reason in ((whole.choices[0].message.content, whole.choices[0].finish_reason), (texts[0], reasons[0])):
        assert re.match(r'\s*\{\s*("|\})', text), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_structured_output_refusals_name_the_field(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    text = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                          response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content  # "text" constrains nothing
    cases = [  # (fields, param, words of llguidance's or our message)
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "nope"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "both"),
    ]
    for extra, param, words in cases:
        err = bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                                 extra_body=extra))
        assert err.param == param and words in err.message, (extra, err.message)


# ---- penalties and logit_bias -----------------------------------------------------------------

PENALTY_TOKENS = 32  # greedy repeats no token within the first 24 that the penalties would flip
PENALIZED = [  # (the request's fields, the same as SamplingParams fields)
    ({"presence_penalty": 1.5, "frequency_penalty": 2.0}, {"presence_penalty": 1.5, "frequency_penalty": 2.0}),
    ({"frequency_penalty": -2.0}, {"frequency_penalty": -2.0}),
    ({"logit_bias": {"FORCED": 100}}, {"logit_bias": (("FORCED", 100.0),)}),
    ({"logit_bias": {"GREEDY": -100}}, {"logit_bias": (("GREEDY", -100.0),)}),
]


@pytest.mark.parametrize(("fields", "params"), PENALIZED, ids=["presence+frequency", "negative-frequency",
                                                               "bias+100", "bias-100"])
def test_penalties_and_logit_bias_sample_as_the_engine_does(client, checkpoint, engine, fields, params):
    """The stack's answer is the in-process engine's with the same parameters, and differs from
    plain greedy (so neither may ignore them)."""
    tok = checkpoint.tokenizer
    ids = tok.encode(PROMPT)
    greedy = engine.generate([ids], SamplingParams(max_tokens=PENALTY_TOKENS, temperature=0))[0].output_ids
    forced = next(t for t in range(3, tok.vocab_size) if t not in greedy)  # a token greedy never picks
    names = {"FORCED": forced, "GREEDY": greedy[0]}
    fields = {k: {str(names[t]): b for t, b in v.items()} if k == "logit_bias" else v for k, v in fields.items()}
    params = {k: tuple((names[t], b) for t, b in v) if k == "logit_bias" else v for k, v in params.items()}
    ref = engine.generate([ids], SamplingParams(max_tokens=PENALTY_TOKENS, temperature=0, **params))[0].output_ids
    assert ref != greedy
    if params.get("logit_bias") == ((forced, 100.0),):
        assert ref == [forced] * PENALTY_TOKENS  # +100 outweighs any logit of this model
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=PENALTY_TOKENS, temperature=0,
                                    extra_body=fields)
    assert got.choices[0].text == tok.decode(ids + ref)[len(tok.decode(ids)):]


def test_penalty_and_logit_bias_refusals(client):
    for extra, param in [({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {"99999": 5}}, "logit_bias"),
                         ({"logit_bias": {"7": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": [1]}, "logit_bias")]:
        err = bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra))
        assert err.param == param, (extra, err.message)
    err = bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                        logit_bias={"99999": 5}))
    assert "vocabulary" in err.message and "511" in err.message


# ---- logprobs ---------------------------------------------------------------------------------

def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=2e-3)


def test_chat_logprobs_equal_the_engine_whole_and_streamed(client, checkpoint, engine):
    tok = checkpoint.tokenizer
    ids = tokenize_chat(tok, CHAT)
    ref = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == len(ref.logprobs) == 8
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    for entry, lp in zip(content, ref.logprobs):
        assert _close(entry.logprob, lp.logprob) and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        for alt, (_, value) in zip(entry.top_logprobs, lp.top):
            assert _close(alt.logprob, value)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the likeliest
    _, streamed, _, _ = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True))
    assert [(e.token, e.logprob) for e in streamed[0]] == [(e.token, e.logprob) for e in content]

    bare = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices[0].logprobs is None
    assert bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)).param == \
        "top_logprobs"
    assert bad_request(lambda: client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True,
                                                              top_logprobs=21)).param == "top_logprobs"


def test_completion_logprobs_equal_the_engine_whole_and_streamed(client, checkpoint, engine):
    ids = checkpoint.tokenizer.encode(PROMPT)
    ref = engine.generate([ids], SamplingParams(max_tokens=10, temperature=0, logprobs=2))[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for value, top, token, r in zip(lp.token_logprobs, lp.top_logprobs, lp.tokens, ref.logprobs, strict=True):
        assert _close(value, r.logprob) and token in top and len(top) <= 3  # the top 2, and the sampled one
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx([v for _, v in r.top], abs=2e-3)
    _, streamed, _ = collect_completion(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                                                  temperature=0, logprobs=2, stream=True))
    assert streamed[0]["tokens"] == lp.tokens and streamed[0]["text_offset"] == lp.text_offset
    assert streamed[0]["token_logprobs"] == lp.token_logprobs


# ---- n choices --------------------------------------------------------------------------------

def _metric(stack, name: str) -> float:
    with urllib.request.urlopen(stack.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M)[1])


def test_n_choices_seeded_whole_and_streamed(stack, client):
    sampling = dict(max_tokens=12, temperature=1.0, top_p=0.95)
    refs = [grpc_generate(stack, PROMPT, seed=40 + i, **sampling)[0] for i in range(3)]
    assert len(set(refs)) > 1  # the seeds sample different stories

    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=40, **sampling)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == refs  # choice i samples with seed + i
    _, prompt_tokens = grpc_generate(stack, PROMPT, 1)
    assert whole.usage.prompt_tokens == prompt_tokens  # the prompt once, the choices' tokens summed
    assert whole.usage.completion_tokens == 3 * 12

    texts, _, reasons, chunks = collect_chat(client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, seed=40, stream=True, stream_options={"include_usage": True}, **sampling))
    chat_refs = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, seed=40, **sampling)
    assert texts == {c.index: c.message.content for c in chat_refs.choices}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 36 and chunks[-1].choices == []
    assert err_param(lambda: client.completions.create(model=MODEL, prompt=PROMPT, n=17)) == "n"


def err_param(call) -> str | None:
    return bad_request(call).param


def test_n_choices_share_the_prompts_kv(stack, client, checkpoint):
    """The n sequences of one request reuse its prompt's blocks: every choice after the first
    finds all of the prompt's full blocks cached (the gateway's prefix-cache counter); the first,
    a prompt never seen before, none."""
    prompt = "A new story: " + " ".join(["The little dog ran to the park and played with a red ball."] * 6)
    full_blocks = len(checkpoint.tokenizer.encode(prompt)) // 16 * 16  # --block-size 16
    before = _metric(stack, "pdserve_prefix_cache_hit_tokens_total")
    out = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=4, temperature=0)
    reused = _metric(stack, "pdserve_prefix_cache_hit_tokens_total") - before
    assert len(out.choices) == 4 and len({c.text for c in out.choices}) == 1  # greedy: the same answer
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # the prompt once: its first computation
    assert reused >= 3 * full_blocks > 0, (reused, full_blocks)


def test_a_client_leaving_mid_stream_ends_every_choice(stack):
    """n long choices, the client gone after the first event: the decode worker frees all their KV."""
    import aiohttp

    def idle() -> bool:
        d, kv = stack.worker_stats("decode-0"), stack.kvstore_stats()
        return (d.num_running == 0 and d.num_waiting == 0 and d.num_blocks_free == d.num_blocks_total
                and kv.num_pinned == 0 and kv.num_leases == 0)

    async def leave() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "n": 3, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(stack.http_url + "/v1/completions", json=body)
            assert resp.status == 200
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
            running = await asyncio.to_thread(wait_until, lambda: stack.worker_stats("decode-0").num_running == 3, 30)
            assert running, "the three choices never ran at once"
            resp.close()
    asyncio.run(leave())
    assert wait_until(idle, 30), (stack.worker_stats("decode-0"), stack.kvstore_stats())


# ---- /v1/completions: echo, batches, token ids ----------------------------------------------

def test_echo_batches_and_token_id_prompts(stack, client, checkpoint):
    prompts = [PROMPT, "Tom had a red ball. He"]
    refs = [grpc_generate(stack, p, 8, temperature=0) for p in prompts]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + refs[0][0]
    texts, _, chunks = collect_completion(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                                    temperature=0, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT and texts[0] == PROMPT + refs[0][0]
    assert err_param(lambda: client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1)) == "echo"

    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [refs[0][0], refs[0][0], refs[1][0], refs[1][0]]
    assert batch.usage.prompt_tokens == refs[0][1] + refs[1][1] and batch.usage.completion_tokens == 32
    texts, _, _ = collect_completion(client.completions.create(model=MODEL, prompt=prompts, max_tokens=8,
                                                               temperature=0, stream=True))
    assert texts == {0: refs[0][0], 1: refs[1][0]}

    ids = [checkpoint.tokenizer.encode(p) for p in prompts]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0, echo=True)
    assert one.choices[0].text == checkpoint.tokenizer.decode(ids[0]) + refs[0][0]
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in both.choices] == [r for r, _ in refs]
    for prompt, param in [([5, 512], "prompt"), ([[5], [6, 600]], "prompt[1]"), ([[]], "prompt[0]")]:
        assert err_param(lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)) == param
    for extra, param in [({"suffix": "end"}, "suffix"), ({"best_of": 2}, "best_of")]:
        err = bad_request(lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **extra))
        assert err.param == param and err.code == "unsupported_parameter"


# ---- system_fingerprint, the over-long prompt's message, tokenize once -------------------------

def test_system_fingerprint_on_every_object_and_chunk(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    fingerprints = {whole.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert len(fingerprints) == 1 and re.fullmatch(r"fp_[0-9a-f]{12}", fingerprints.pop())


def test_over_long_prompt_states_the_requests_own_numbers(client, checkpoint):
    window = checkpoint.config.max_position_embeddings  # the context window (2048)
    long_prompt = " ".join(["the"] * (window - 60))
    tokens = len(checkpoint.tokenizer.encode(long_prompt))
    err = bad_request(lambda: client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=100))
    assert err.param == "max_tokens" and err.code == "context_length_exceeded"
    assert f"{tokens} tokens" in err.message and "100" in err.message and str(window) in err.message
    assert f"max_tokens to at most {window - tokens}" in err.message
    too_long = " ".join(["the"] * (window + 50))
    tokens = len(checkpoint.tokenizer.encode(too_long))
    for max_tokens in (None, 1):
        kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
        err = bad_request(lambda: client.completions.create(model=MODEL, prompt=too_long, **kwargs))
        assert err.param == "prompt" and f"{tokens} tokens" in err.message and "at most 0" not in err.message
        assert f"shorten the prompt to at most {window - (max_tokens or 1)} tokens" in err.message


class _CountingTokenizer:
    """The deployment's real tokenizer, counting the prompts it encodes."""

    def __init__(self, inner) -> None:
        self.inner, self.encoded = inner, 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encoded += 1
        return self.inner.encode(text, add_bos)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_prompt_is_tokenized_once(stack):
    """An in-process gateway over the stack's workers, its tokenizer counted."""
    from aiohttp.test_utils import TestClient, TestServer

    from gateway.deployments import Catalog
    from gateway.http.app import create_app
    from gateway.limits import InflightLimit
    from gateway.server import start_deployment

    async def scenario() -> int:
        addr = {n: stack.child(n).spec.address for n in ("prefill-0", "decode-0", "kvstore")}
        deployment = await start_deployment(MODEL, str(STORIES_GGUF), 16, "float32", addr["prefill-0"],
                                            addr["decode-0"], addr["kvstore"], InflightLimit(8), "float32", None)
        counting = _CountingTokenizer(deployment.flow.model.tokenizer)
        deployment.flow.model = dataclasses.replace(deployment.flow.model, tokenizer=counting)
        try:
            async with TestClient(TestServer(create_app(Catalog([deployment])))) as http:
                resp = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                                     "max_tokens": 3})
                assert resp.status == 200, await resp.text()
        finally:
            await deployment.close()
        return counting.encoded
    assert asyncio.run(scenario()) == 1


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_with_a_template_that_has_no_tool_support(client) -> None:
    """stories260K's default chat template renders no tools: asking the model to use them is a 400
    naming `tools`; tool_choice "none" asks nothing of them and answers as without tools."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER_TOOL], max_tokens=4)
    assert err.value.body["param"] == "tools" and "no tool support" in err.value.body["message"]
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    none = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[WEATHER_TOOL], tool_choice="none",
                                          temperature=0, max_tokens=12)
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
