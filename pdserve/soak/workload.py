"""The soak's requests and their ledger: what was sent, and how each one ended.

Every request is greedy on one of a few prompts whose reference output the in-process engine
computed, so each stream can be checked token by token: a completed stream must equal the
reference exactly (nothing lost or repeated, even across a resume), and a cancelled or failed one
must be a prefix of it. A request id is used once; every chunk must carry it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = (
    "Once upon a time",
    "Tom had a red ball.",
    "The sun was hot and the birds were singing in the tall green trees. A little",
    "Lily wanted to play with her friend, but",
    "One day, a big dog named Max went to the park with his friend, a small cat. They played",
    "Sam was sad because his toy was broken. His mom said",
)
LENGTHS = (4, 16, 48)  # max_tokens: short, medium, long
# What a request may end with under faults besides OK and our own cancel (anything else fails):
# UNAVAILABLE when no worker could serve it, RESOURCE_EXHAUSTED when admission refused it,
# DEADLINE_EXCEEDED when it ran past --request-timeout-s.
DOCUMENTED = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    prompt: int  # index into PROMPTS
    max_tokens: int
    cancel_after: int | None  # cancel after this many chunks (0: at once); None: read to the end


@dataclass(slots=True)
class Outcome:
    spec: RequestSpec
    status: str  # "OK", "CANCELLED" (by us) or the gRPC status name
    details: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)  # every non-empty one seen, in order
    foreign_ids: int = 0  # chunks carrying another request id
    after_finish: int = 0  # chunks after the one with the finish reason
    started_s: float = 0.0
    ended_s: float = 0.0


def make_specs(n: int, cancel_rate: float, rng: random.Random) -> list[RequestSpec]:
    return [RequestSpec(f"soak-{i:06d}-{rng.getrandbits(32):08x}", rng.randrange(len(PROMPTS)), rng.choice(LENGTHS),
                        rng.randint(0, 3) if rng.random() < cancel_rate else None) for i in range(n)]


def run_request(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, timeout_s: float, t0: float) -> Outcome:
    """Send one Generate and read it to its end (or to our cancel); never raises for the call."""
    out = Outcome(spec, "OK", started_s=time.monotonic() - t0)
    request = gateway_pb2.GenerateRequest(request_id=spec.request_id, prompt=PROMPTS[spec.prompt],
                                          sampling=common_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0))
    call = stub.Generate(request, timeout=timeout_s)
    try:
        if spec.cancel_after == 0:
            call.cancel()
        for i, chunk in enumerate(call):
            _record(out, chunk)
            if spec.cancel_after is not None and i + 1 >= spec.cancel_after:
                call.cancel()
                break
    except grpc.RpcError as err:
        ours = spec.cancel_after is not None and err.code() == grpc.StatusCode.CANCELLED
        out.status, out.details = ("CANCELLED", "") if ours else (err.code().name, err.details() or "")
    else:
        if spec.cancel_after is not None and not out.finish_reasons:
            out.status = "CANCELLED"
    out.ended_s = time.monotonic() - t0
    return out


def _record(out: Outcome, chunk: gateway_pb2.GenerateResponse) -> None:
    out.after_finish += bool(out.finish_reasons)
    out.tokens.extend(chunk.token_ids)
    if chunk.finish_reason:
        out.finish_reasons.append(chunk.finish_reason)
    if chunk.request_id != out.spec.request_id:
        out.foreign_ids += 1
