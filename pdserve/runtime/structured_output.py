"""What a request's output must match (JSON schema, any JSON object, regex, choice, grammar),
as one value that travels with its SamplingParams from the API edge to whichever worker samples.

The grammar engine is llguidance (kept library, Rust, CPU; the one vLLM and SGLang also ship):
`grammar_text` turns a spec into llguidance's grammar, and `check` compiles it without a
tokenizer, so the gateway refuses a spec it cannot honour (400 / INVALID_ARGUMENT) before any
worker sees it. Workers build the token-level matcher from the same text (see
`pdserve.runtime.grammar`), so what the gateway accepted is what they enforce.

kinds:
    json_schema  spec = the schema as JSON text (OpenAI response_format json_schema, vLLM guided_json)
    json_object  spec = "" (any JSON object: OpenAI response_format json_object)
    regex        spec = the regular expression (vLLM guided_regex)
    choice       spec = a JSON array of the allowed strings (vLLM guided_choice)
    grammar      spec = a Lark grammar (llguidance's dialect) or a GBNF grammar as llama.cpp and
                 vLLM take it (guided_grammar); GBNF is converted to Lark by llguidance
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema or grammar larger than this is refused (compile time grows with it)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured output: the {self.kind} spec has {len(self.spec)} characters; at most"
                             f" {MAX_SPEC_CHARS}")


# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): with llguidance's
# default flexible whitespace a model may emit newlines forever inside a valid object (a small one
# does, at once). A schema can still ask for other whitespace through its "x-guidance" options.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=256)  # specs of up to 64 KiB: a bounded cache, ~32 MiB at worst
def grammar_text(so: StructuredOutput) -> str:
    """llguidance's grammar for `so`; ValueError with a message a person can act on. Cached:
    the gateway and every worker turn the same spec into text more than once."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if so.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
    if so.kind == "json_schema":
        schema = _json(so.spec, "the JSON schema")
        if not isinstance(schema, dict | bool):
            raise ValueError("the JSON schema must be an object (or true/false)")
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if so.kind == "regex":
        return LLMatcher.grammar_from_regex(so.spec)
    if so.kind == "choice":
        choices = _json(so.spec, "the choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty array of strings")
        return LLMatcher.grammar_from_regex("|".join(_regex_literal(c) for c in choices))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(so.spec))
    except Exception as err:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"the grammar is neither valid Lark nor GBNF: {err}") from None


def check(so: StructuredOutput) -> None:
    """Compile `so` (no tokenizer needed); ValueError naming what llguidance refused. The verdict
    is cached by spec: a client that sends the same schema with every request pays once."""
    error = _compile_error(so)
    if error:
        raise ValueError(error)


@functools.lru_cache(maxsize=256)
def _compile_error(so: StructuredOutput) -> str:
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_text(so))
    except ValueError as err:
        return str(err)
    return f"the {so.kind} cannot be compiled: {error}" if error else ""


def _json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is not valid JSON: {err}") from None


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it (llguidance's regex syntax is Rust's)."""
    return "(" + "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text) + ")"
