"""Protobuf <-> dataclass conversion for the messages the gateway shares with clients and workers.

Unset `optional` proto fields take the defaults of `SamplingParams` (max_tokens 16, temperature
1.0, top_p 1.0, repetition_penalty 1.0); building the dataclass validates the values and raises
ValueError with a message naming the bad field.
"""

from __future__ import annotations

from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.v1 import common_pb2

_DEFAULTS = SamplingParams()
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed")


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The validated SamplingParams of a request; ValueError on a bad value."""
    optional = {name: getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)
                for name in _OPTIONAL_FIELDS}
    return SamplingParams(
        **optional,
        top_k=msg.top_k,
        min_p=msg.min_p,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The proto of `params`, every field set explicitly so that workers never guess a default."""
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        repetition_penalty=params.repetition_penalty,
        logprobs=params.logprobs,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
