"""pdserve.proto_convert, the one protobuf <-> dataclass converter of the gateway and the workers.

The round trips are generated from `dataclasses.fields` and the field checks from the message
DESCRIPTORs, so that a field added to SamplingParams, TokenLogprob or common.proto without being
mapped in the converter fails here instead of being silently dropped on the wire.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

import pytest

from pdserve.proto_convert import (
    logprob_from_proto,
    logprob_to_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.runtime.structured_output import StructuredOutput
from pdserve.v1 import common_pb2

# Fields a generic rule below cannot give a valid non-default value, with the value to use.
# structured: a spec is valid only with a known kind and a spec of that kind.
_EXPLICIT: dict[tuple[type, str], Any] = {
    (SamplingParams, "structured"): StructuredOutput("json_schema", '{"type": "object"}'),
}

# Fields deliberately on one side only, with the reason. None today; an entry here is a decision
# that the field is not carried across the wire.
_PROTO_ONLY: dict[str, str] = {}
_DATACLASS_ONLY: dict[str, str] = {}
# TokenLogprob.top is a tuple of (token_id, logprob) pairs, not a dataclass: its pair positions
# stand for the TopLogprob fields in this order.
_TOP_PAIR = ("token_id", "logprob")


def _value(tp: Any, default: Any, salt: int) -> Any:
    """A valid non-default value of type `tp` (`default` may be MISSING); `salt` varies the value
    between items of a tuple. Floats are multiples of 1/4, exact in the proto's float32."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    has_default = default is not dataclasses.MISSING and default is not None
    if tp is bool:
        return not default if has_default else True
    if tp is int:
        return (default if has_default else 0) + salt
    if tp is float:
        return default / 2 if has_default and default else 0.25 * salt
    if tp is str:
        return f"s{salt}"
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # `X | None`: set it
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, dataclasses.MISSING, salt)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # variable length: two items
        return tuple(_value(args[0], dataclasses.MISSING, salt + i) for i in range(2))
    if origin is tuple:
        return tuple(_value(a, dataclasses.MISSING, salt + i) for i, a in enumerate(args))
    raise LookupError(f"no generic value for type {tp!r}")


def _full(cls: type) -> dict[str, Any]:
    """Every field of dataclass `cls` set to a valid value other than its default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if (cls, f.name) in _EXPLICIT:
            values[f.name] = _EXPLICIT[(cls, f.name)]
            continue
        try:
            values[f.name] = _value(hints[f.name], f.default, salt=1)
        except LookupError as err:
            pytest.fail(f"{cls.__name__}.{f.name}: {err}; add a value to _EXPLICIT")
        assert values[f.name] != f.default, f"{cls.__name__}.{f.name}: the generated value is its default"
    return values


def _proto_fields(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.fields}


def _dataclass_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}

# ---- SamplingParams -----------------------------------------------------------------------------


def test_sampling_round_trip_of_every_field() -> None:
    params = SamplingParams(**_full(SamplingParams))
    msg = sampling_to_proto(params)
    assert sampling_from_proto(msg) == params
    # Every proto field carries something: one left unset would be a field the converter dropped.
    assert {f.name for f, _ in msg.ListFields()} == _proto_fields(common_pb2.SamplingParams) - set(_PROTO_ONLY)


def test_sampling_fields_map_both_ways() -> None:
    proto, dataclass = _proto_fields(common_pb2.SamplingParams), _dataclass_fields(SamplingParams)
    assert proto - dataclass == set(_PROTO_ONLY), "proto fields with no SamplingParams field"
    assert dataclass - proto == set(_DATACLASS_ONLY), "SamplingParams fields with no proto field"


def test_sampling_defaults_match_the_dataclass() -> None:
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    # And in the other direction: the defaults are sent explicitly, except the absent seed.
    sent = {f.name for f, _ in sampling_to_proto(SamplingParams()).ListFields()}
    assert sent == {"max_tokens", "temperature", "top_p", "repetition_penalty"}


@pytest.mark.parametrize("name", [f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields
                                  if f.has_presence and f.message_type is None])  # scalars (not `structured`)
def test_sampling_optional_zero_is_not_the_default(name: str) -> None:
    """A set optional field is taken as sent even at the proto's zero (temperature 0 is greedy):
    kept, or refused naming the field; never replaced by the default as if it were unset."""
    msg = common_pb2.SamplingParams()
    setattr(msg, name, 0)
    try:
        params = sampling_from_proto(msg)
    except ValueError as err:
        assert re.match(rf"{name}\b", str(err)), str(err)
    else:
        assert getattr(params, name) == 0


def test_sampling_large_seed_survives() -> None:
    params = SamplingParams(seed=2**63 + 5)  # uint64 on the wire: not truncated to 32 bits
    assert sampling_from_proto(sampling_to_proto(params)).seed == 2**63 + 5


@pytest.mark.parametrize("name, value", [
    ("max_tokens", 0),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("logprobs", 21),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", math.nan),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {-1: 1.0}),
    ("structured", common_pb2.StructuredOutput(kind="yaml")),
    ("structured", common_pb2.StructuredOutput(kind="regex", spec="a" * (64 * 1024 + 1))),
])
def test_bad_sampling_from_proto_names_the_field(name: str, value: Any) -> None:
    msg = common_pb2.SamplingParams()
    if isinstance(value, list):
        getattr(msg, name).extend(value)
    elif isinstance(value, dict):
        getattr(msg, name).update(value)
    elif isinstance(value, common_pb2.StructuredOutput):
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)
    # `\b` so that a "stop" error does not pass for a "stop_token_ids" one
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        sampling_from_proto(msg)


@pytest.mark.parametrize("fields, name", [
    ({"seed": -1}, "seed"),  # uint64
    ({"max_tokens": 2**31}, "max_tokens"),  # int32
    ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": (2**31,)}, "stop_token_ids"),
    ({"logit_bias": ((2**31, 1.0),)}, "logit_bias"),
])
def test_unsendable_sampling_to_proto_names_the_field(fields: dict, name: str) -> None:
    """Values SamplingParams accepts but the proto cannot carry (protobuf names only the value)."""
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        sampling_to_proto(SamplingParams(**fields))

# ---- TokenLogprob -------------------------------------------------------------------------------


def test_logprob_round_trip_of_every_field() -> None:
    lp = TokenLogprob(**_full(TokenLogprob))
    assert lp.top, "the generated value must have alternatives to carry"
    assert logprob_from_proto(logprob_to_proto(lp)) == lp
    assert [logprob_from_proto(m) for m in logprobs_to_proto([lp, lp])] == [lp, lp]


def test_logprob_fields_map_both_ways() -> None:
    assert _proto_fields(common_pb2.TokenLogprob) == _dataclass_fields(TokenLogprob)
    assert tuple(f.name for f in common_pb2.TopLogprob.DESCRIPTOR.fields) == _TOP_PAIR
    hints = typing.get_type_hints(TokenLogprob)
    pair = typing.get_args(hints["top"])[0]
    assert typing.get_args(pair) == tuple(type(getattr(common_pb2.TopLogprob(), n)) for n in _TOP_PAIR)


def test_logprob_order_of_alternatives_is_kept() -> None:
    lp = TokenLogprob(3, -0.25, ((9, -0.5), (1, -1.0), (5, -2.0)))
    assert [t.token_id for t in logprob_to_proto(lp).top] == [9, 1, 5]
    assert logprob_from_proto(logprob_to_proto(lp)).top == lp.top


def test_logit_bias_travels_as_a_map_in_any_order() -> None:
    """OpenAI's logit_bias is a JSON object: the order a client wrote it in means nothing, and the
    dataclass keeps one (by token id) so that equal requests compare equal on both sides."""
    params = SamplingParams(logit_bias=((9, -100.0), (3, 2.5)))
    assert params.logit_bias == ((3, 2.5), (9, -100.0))
    msg = sampling_to_proto(params)
    assert dict(msg.logit_bias) == {3: 2.5, 9: -100.0}
    assert sampling_from_proto(msg) == params


def test_structured_output_unset_is_none_and_set_is_kept() -> None:
    assert not sampling_to_proto(SamplingParams()).HasField("structured")
    so = StructuredOutput("choice", '["yes", "no"]')
    msg = sampling_to_proto(SamplingParams(structured=so))
    assert (msg.structured.kind, msg.structured.spec) == ("choice", '["yes", "no"]')
    assert sampling_from_proto(msg).structured == so
