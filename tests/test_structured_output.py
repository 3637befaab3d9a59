"""Structured output in the engine: outputs under a JSON schema, regex, choice or grammar match it.

References: the `jsonschema` package (and `re`, and the set of choices) on the decoded text; an
llguidance matcher of our own over a tokenizer transformers builds from the same GGUF, which must
accept every token the engine sampled; the same requests run alone (batching changes nothing), and
uninterrupted (a resumed stream or a prefill handed to decode continues the same state).
stories260K is a toy model, but the grammar keeps even its output valid: the schemas bound their
strings, arrays and numbers, so its outputs end (a small model writes digits or text forever).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import STORIES_GGUF
from hf_reference import load_hf_gguf_tokenizer
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import AddRequest, Engine, RequestError
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.structured_output import StructuredOutput, grammar_text

MAX_TOKENS = 120
NAME = {"type": "string", "maxLength": 12}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


def _digit(lo: int = 0, hi: int = 9) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS: dict[str, dict] = {
    "flat": _obj({"name": NAME, "age": _digit(0, 120)}),
    "nested": _obj({"pet": _obj({"kind": {"enum": ["cat", "dog", "bird"]}, "legs": _digit(0, 4)})}),
    "deep": _obj({"a": _obj({"b": _obj({"c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}})})}),
    "enum_strings": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["one", 2, True, None]},
    "const": _obj({"version": {"const": 2}, "ok": {"type": "boolean"}}),
    "boolean": {"type": "boolean"},
    "array_bounds": {"type": "array", "items": _digit(1, 9), "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "array", "items": _obj({"id": _digit(0, 99)}), "minItems": 1, "maxItems": 3},
    "array_of_enum": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "tuple": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 6}, _digit()], "items": False,
              "minItems": 2},
    "required_subset": _obj({"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "null"}}, ["a", "c"]),
    "optional_props": _obj({"title": NAME, "year": _digit(1900, 2100),
                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}},
                           ["title"]),
    "int_bounds": _digit(-50, 50),
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "number_multiple": _obj({"x": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}),
    "string_pattern": {"type": "string", "pattern": "^[a-z]{3,8}$"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "code_pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    "date_format": _obj({"day": {"type": "string", "format": "date"}}),
    "anyof": {"anyOf": [_digit(), {"type": "string", "maxLength": 4}]},
    "anyof_objects": {"anyOf": [_obj({"cat": {"type": "boolean"}}), _obj({"dog": _digit(0, 3)})]},
    "ref_defs": {"$defs": {"point": _obj({"x": _digit(), "y": _digit()})},
                 **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "ref_recursive": {"$defs": {"node": _obj({"v": _digit(), "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                  {"type": "null"}]}})},
                      "$ref": "#/$defs/node"},
}

# Other kinds, each with a reference check of the decoded text.
REGEX = r"(yes|no), [0-9]{1,3} (cats|dogs)"
CHOICES = ["red", "green", "blue and gold"]
GBNF = 'root ::= "The " animal " is " ("big" | "small") "."\nanimal ::= "cat" | "dog" | "bird"'
LARK = 'start: "(" NUM ("+" NUM){0,3} ")"\nNUM: /[0-9]{1,2}/'
OTHERS: dict[str, tuple[StructuredOutput, object]] = {
    "regex": (StructuredOutput("regex", REGEX), lambda text: re.fullmatch(REGEX, text)),
    "choice": (StructuredOutput("choice", json.dumps(CHOICES)), lambda text: text in CHOICES),
    "gbnf": (StructuredOutput("grammar", GBNF),
             lambda text: re.fullmatch(r"The (cat|dog|bird) is (big|small)\.", text)),
    "lark": (StructuredOutput("grammar", LARK), lambda text: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2}){0,3}\)", text)),
}


def schema_spec(name: str) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(SCHEMAS[name]))


def all_specs() -> dict[str, StructuredOutput]:
    return {**{n: schema_spec(n) for n in SCHEMAS}, **{n: so for n, (so, _) in OTHERS.items()}}


def assert_valid(name: str, text: str) -> None:
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    else:
        assert OTHERS[name][1](text), (name, text)


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def engine(checkpoint):
    e = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=512),
                                                        scheduler=SchedulerConfig(max_num_seqs=64)))
    yield e
    e.check_leaks()
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


@pytest.fixture(scope="module")
def reference_tokenizer(tmp_path_factory):
    """llguidance's tokenizer over transformers' tokenizer of the same GGUF (not ours)."""
    import llguidance.hf

    hf = load_hf_gguf_tokenizer(STORIES_GGUF, tmp_path_factory.mktemp("tok"))
    return llguidance.hf.from_tokenizer(hf, n_vocab=512, eos_token=2)


@pytest.fixture(scope="module")
def prompt(checkpoint) -> list[int]:
    return checkpoint.tokenizer.encode("Once upon a time")


def run_batch(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """All requests in one continuous batch; their output tokens by name (each must end "stop")."""
    seqs = {name: engine.add_request(f"{name}-{id(requests)}", p, params) for name, (p, params) in requests.items()}
    while engine.has_unfinished():
        engine.step()
    for name, seq in seqs.items():
        assert seq.finish_reason == "stop", (name, seq.finish_reason, seq.output_ids)
    return {name: seq.output_ids for name, seq in seqs.items()}


def params(so: StructuredOutput | None, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=7, structured=so, **kw)


@pytest.fixture(scope="module")
def batched(engine, prompt) -> dict[float, dict[str, list[int]]]:
    """Every spec, greedy and sampled, each in one batch with two unconstrained sequences."""
    out = {}
    for temperature in (0.0, 1.0):
        requests = {n: (prompt, params(so, temperature)) for n, so in all_specs().items()}
        requests["free-greedy"] = (prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        requests["free-sampled"] = (prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))
        seqs = {n: engine.add_request(f"b{temperature}-{n}", p, sp) for n, (p, sp) in requests.items()}
        while engine.has_unfinished():
            engine.step()
        out[temperature] = {n: s.output_ids for n, s in seqs.items()}
        for n, s in seqs.items():
            assert s.finish_reason == ("length" if n.startswith("free") else "stop"), (n, s.output_ids)
    return out


def test_at_least_twenty_schemas():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate(batched, checkpoint, temperature):
    tok = checkpoint.tokenizer
    for name in all_specs():
        output = batched[temperature][name]
        assert not set(output) & set(checkpoint.config.eos_token_ids), name  # the grammar ended it
        assert_valid(name, tok.decode(output))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_token_is_accepted_by_a_reference_matcher(batched, reference_tokenizer, temperature):
    from llguidance import LLMatcher

    for name, so in all_specs().items():
        matcher = LLMatcher(reference_tokenizer, grammar_text(so))
        for i, token in enumerate(batched[temperature][name]):
            assert matcher.consume_token(token), (name, i, matcher.get_error())
        assert matcher.is_accepting() and matcher.is_stopped(), name  # ended exactly when complete


def test_a_batch_equals_each_run_alone(engine, batched, prompt):
    """Constrained and unconstrained rows share steps and masks; each row still gets its own."""
    for temperature, names in ((0.0, ["nested", "regex"]), (1.0, ["ref_recursive", "gbnf"])):
        for name in names:
            so = all_specs()[name]
            alone = run_batch(engine, {name: (prompt, params(so, temperature))})[name]
            assert alone == batched[temperature][name], (name, temperature)
    free = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True))[0]
    assert free.output_ids == batched[1.0]["free-sampled"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_stream_continues_the_same_output(engine, prompt, temperature):
    """The prompt + the tokens delivered so far, resumed_tokens of them, continue in the same
    grammar state (and, seeded, on the same random stream) to the uninterrupted output."""
    for name in ("ref_defs", "lark"):
        so = all_specs()[name]
        whole = run_batch(engine, {name: (prompt, params(so, temperature))})[name]
        for cut in (1, len(whole) - 2):
            left = SamplingParams(max_tokens=MAX_TOKENS - cut, temperature=temperature, seed=7, structured=so)
            seq = engine.add(AddRequest(f"resume-{name}-{cut}-{temperature}", prompt + whole[:cut], left,
                                        resumed_tokens=cut))
            while engine.has_unfinished():
                engine.step()
            assert seq.output_ids == whole[cut:], (name, cut)
            assert seq.finish_reason == "stop"


def test_prefill_then_decode_continues_the_grammar(engine, prompt):
    """The prefill role samples the first token under the grammar; the decode side builds its own
    matcher, advances it over that token, and goes on to the one-process output."""
    so = schema_spec("flat")
    whole = run_batch(engine, {"flat": (prompt, params(so))})["flat"]
    held = engine.add(AddRequest("pf", prompt, params(so), hold_blocks=True))
    while engine.has_unfinished():
        engine.step()
    engine.release_held("pf")
    first = held.output_ids[0]
    decode = engine.add(AddRequest("dc", prompt, params(so), first_token=first,
                                   prompt_hashes=engine.kv_format.prompt_hashes(prompt)))
    while engine.has_unfinished():
        engine.step()
    assert [first, *decode.output_ids[1:]] == whole and decode.output_ids[0] == first


def test_the_grammar_ends_the_sequence_without_eos(engine, checkpoint, prompt):
    """A grammar that is complete stops the sequence at once ("stop"); no EOS is sampled after it."""
    out = run_batch(engine, {"choice": (prompt, params(StructuredOutput("choice", '["yes", "no"]')))})["choice"]
    assert checkpoint.tokenizer.decode(out) in ("yes", "no")
    assert not set(out) & set(checkpoint.config.eos_token_ids)


def test_logit_bias_cannot_unmask_a_token(engine, checkpoint, prompt):
    """The grammar's mask comes first: +100 on a token the grammar forbids does not let it through."""
    tok = checkpoint.tokenizer
    free = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0].output_ids[0]
    so = StructuredOutput("regex", "[0-9]{2}")
    out = run_batch(engine, {"d": (prompt, params(so, logit_bias=((free, 100.0),)))})["d"]
    assert re.fullmatch("[0-9]{2}", tok.decode(out)) and free not in out


def test_ignore_eos_keeps_a_grammar_going_while_it_may(engine, checkpoint, prompt):
    """With ignore_eos, EOS is taken out while the grammar can go on: `a+` runs to max_tokens."""
    so = StructuredOutput("regex", "[a-z]+")
    seq = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, structured=so))[0]
    assert seq.finish_reason == "length" and re.fullmatch("[a-z]+", checkpoint.tokenizer.decode(seq.output_ids))


@pytest.mark.parametrize("request_kw, message", [
    ({"params": SamplingParams(logit_bias=((512, 1.0),))}, r"logit_bias .*\[0, 512\): 512"),
    ({"params": SamplingParams(structured=StructuredOutput("grammar", 'start: <[5000]> "a"'))},
     "Token range end too large: 5000"),
    ({"params": SamplingParams(structured=StructuredOutput("regex", "[0-9]+")), "first_token": 300},
     "does not match the structured output spec"),
])
def test_bad_requests_are_refused_at_admission(engine, prompt, request_kw, message):
    """Token ids outside the vocabulary (logit_bias, a grammar's token literal) and generated tokens
    the grammar refuses are the request's fault: RequestError (INVALID_ARGUMENT at a worker)."""
    kw = dict(request_kw)
    request = AddRequest("bad", prompt, kw.pop("params"), **kw)
    with pytest.raises(RequestError, match=message):
        engine.add(request)
    assert "bad" not in engine.seqs


def test_an_engine_without_a_tokenizer_refuses_structured_output(make_engine):
    from conftest import model_config_from_hf, random_hf_model

    hf = random_hf_model("llama", seed=1)
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict())
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request("r", [5, 6], SamplingParams(structured=StructuredOutput("json_object")))


def test_compiled_grammars_are_cached(engine):
    grammars = engine.grammars()
    first = grammars.matcher(schema_spec("flat"))
    second = grammars.matcher(schema_spec("flat"))
    assert first.ll is not second.ll  # each sequence its own state
    assert len([t for t in grammars._compiled if t == grammar_text(schema_spec("flat"))]) == 1


# ---- SmolLM2-135M-Instruct: a real instruct model, a 49K vocabulary ---------------------------

SMOL_SCHEMA = _obj({"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 30},
                    "color": {"enum": ["black", "white", "orange", "grey"]}})


def test_smollm2_json_object_and_schema(smollm2):
    """Greedy, batched with an unconstrained request: JSON that parses, and validates."""
    engine = Engine.from_checkpoint(smollm2, EngineConfig(cache=CacheConfig(num_blocks=128)))
    tok = smollm2.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                "Describe a cat as JSON with its name, age and color."}]))
    requests = {
        "object": (chat, SamplingParams(max_tokens=48, temperature=0, structured=StructuredOutput("json_object"))),
        "schema": (chat, SamplingParams(max_tokens=48, temperature=0,
                                        structured=StructuredOutput("json_schema", json.dumps(SMOL_SCHEMA)))),
    }
    free = engine.add_request("free", chat, SamplingParams(max_tokens=4, temperature=0))
    outs = run_batch(engine, requests)
    assert free.is_finished
    assert isinstance(json.loads(tok.decode(outs["object"])), dict)
    jsonschema.validate(json.loads(tok.decode(outs["schema"])), SMOL_SCHEMA)
    engine.check_leaks()


def test_padding_rows_past_the_vocabulary_are_never_allowed(checkpoint):
    """A model whose logits are wider than its tokenizer's vocabulary (an embedding padded to a
    multiple of 64, say): the extra ids are masked off even where any token is allowed."""
    from pdserve.runtime.grammar import GrammarCompiler

    compiler = GrammarCompiler.for_tokenizer(checkpoint.tokenizer, 600, (2,))
    inside = compiler.matcher(StructuredOutput("regex", "[a-z ]{0,50}"))  # most tokens allowed
    allowed = compiler.allowed([inside, None])
    assert allowed.shape == (2, 600)
    assert not allowed[:, 512:].any()
    assert allowed[0, :512].sum() > 50 and allowed[1, :512].all()
