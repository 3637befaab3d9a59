"""Protobuf <-> runtime dataclasses for the messages shared by clients, the gateway and the workers.

The one converter of `common.proto`'s SamplingParams and TokenLogprob, so that the gateway and the
workers cannot drift apart on a default or a field. Unset `optional` proto fields take the defaults
of `SamplingParams` (max_tokens 16, temperature 1.0, top_p 1.0, repetition_penalty 1.0, no seed);
building the dataclass validates the values, and a bad value in either direction raises ValueError
with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.runtime.structured_output import StructuredOutput
from pdserve.v1 import common_pb2

_DEFAULTS = SamplingParams()
# Field groups by how the proto carries them; tests/test_proto_convert.py checks that together they
# cover every field of both the proto message and the dataclass.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty")  # presence tracked
_PLAIN_FIELDS = ("top_k", "min_p", "ignore_eos", "logprobs", "presence_penalty",
                 "frequency_penalty")  # proto zero == dataclass default
_REPEATED_FIELDS = ("stop", "stop_token_ids")
# And two of their own: logit_bias (a map token id -> bias; the dataclass keeps its pairs sorted by id)
# and structured (a message, unset for None).


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The validated SamplingParams of a request; ValueError naming the field on a bad value."""
    kwargs: dict[str, object] = {
        name: getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)
        for name in _OPTIONAL_FIELDS}
    kwargs.update({name: getattr(msg, name) for name in _PLAIN_FIELDS})
    kwargs.update({name: tuple(getattr(msg, name)) for name in _REPEATED_FIELDS})
    kwargs["logit_bias"] = tuple(sorted(msg.logit_bias.items()))
    kwargs["structured"] = structured_from_proto(msg.structured) if msg.HasField("structured") else None
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    """The spec of a request (its kind checked; whether it compiles is `structured_output.check`'s)."""
    return StructuredOutput(msg.kind, msg.spec)  # type: ignore[arg-type]


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto of `params`, every field set explicitly so that workers never guess a default.

    A value the proto cannot carry (a negative seed, an int beyond int32) raises ValueError naming
    the field, where protobuf's own message names only the value."""
    msg = common_pb2.SamplingParams()
    for name in _OPTIONAL_FIELDS + _PLAIN_FIELDS:
        value = getattr(params, name)
        if value is None:  # only seed: left unset so that the worker samples nondeterministically
            continue
        try:
            setattr(msg, name, value)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{name} cannot be sent: {err}") from err
    for name in _REPEATED_FIELDS:
        try:
            getattr(msg, name).extend(getattr(params, name))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{name} cannot be sent: {err}") from err
    try:
        msg.logit_bias.update(dict(params.logit_bias))
    except (ValueError, TypeError) as err:
        raise ValueError(f"logit_bias cannot be sent: {err}") from err
    if params.structured is not None:
        msg.structured.CopyFrom(common_pb2.StructuredOutput(kind=params.structured.kind, spec=params.structured.spec))
    return msg


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    """The proto of one sampled token's logprob and its top alternatives, most likely first."""
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_to_proto(lps: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    """`logprob_to_proto` of each, in order."""
    return [logprob_to_proto(lp) for lp in lps]


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    """The dataclass of one TokenLogprob message; `top` becomes (token id, logprob) pairs."""
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))
