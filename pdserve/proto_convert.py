"""Protobuf <-> runtime dataclasses, in one place at the service edge."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.sequence import TokenLogprob
from pdserve.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the documented defaults; bad values raise ValueError."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else defaults.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else defaults.repetition_penalty),
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        seed=p.seed, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        repetition_penalty=p.repetition_penalty, logprobs=p.logprobs, ignore_eos=p.ignore_eos)


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_to_proto(lps: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps]


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))
