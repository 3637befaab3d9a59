"""The soak's requests and their ledger: what was sent, and how each one ended.

Every request is greedy on one of a few prompts whose reference output the in-process engine
computed, so each stream can be checked token by token: a completed stream must equal the
reference exactly (nothing lost or repeated, even across a resume), and a cancelled or failed one
must be a prefix of it. A request id is used once; every chunk must carry it.

Besides the load's own requests (kind "load", on PROMPTS), two faults send requests of their own,
on prompts the load never sends, recorded in the same ledger: "prefill-cancel" requests on
LONG_PROMPTS (about 1200 tokens, so that their prefill takes a while) are cancelled while their
prefill runs, and "poison" requests on POISON_PROMPTS follow forged KV blocks put under their
prompt's block hashes (see pdserve.soak.attacks).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.soak.faults import Progress
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = (
    "Once upon a time",
    "Tom had a red ball.",
    "The sun was hot and the birds were singing in the tall green trees. A little",
    "Lily wanted to play with her friend, but",
    "One day, a big dog named Max went to the park with his friend, a small cat. They played",
    "Sam was sad because his toy was broken. His mom said",
)
_STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with "
          "her friends. One day, she saw a big red ball under a tree and ran to get it. ")
# ~1200 tokens: 3 prefill steps of the default 512-token budget. A distinct first word per prompt
# gives distinct block hashes, so that bursts in turn each find a cold prefix.
LONG_PROMPTS = tuple(f"{name} read a long story. " + _STORY * 32 for name in ("Mia", "Leo", "Zoe", "Max"))
# A distinct first word gives each a distinct first block, so no earlier request left genuine KV
# under its hashes: a forged block put first is what a reader would find.
POISON_PROMPTS = tuple(f"{name} found a shiny stone near the river. It was smooth and blue, and it glowed at night. "
                       f"{name} put it in a box and showed it to a friend, who"
                       for name in ("Anna", "Ben", "Carl", "Dora", "Emma", "Finn", "Gus", "Hana"))
ALL_PROMPTS = (*PROMPTS, *LONG_PROMPTS, *POISON_PROMPTS)  # RequestSpec.prompt indexes this
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
    kind: str = "load"  # "load", "prefill-cancel" (cancelled during its prefill) or "poison"


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


class LoadLog:
    """Every request sent and every outcome, from all client threads, with the Progress the fault
    schedule waits on. `run(...)` sends one request and records both."""

    def __init__(self, stub_factory: Callable[[], gateway_pb2_grpc.GatewayStub], timeout_s: float,
                 progress: Progress | None = None) -> None:
        self.stub_factory = stub_factory
        self.timeout_s = timeout_s
        self.progress = progress or Progress()
        self.sent: list[RequestSpec] = []
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()

    def run(self, spec: RequestSpec, stub: gateway_pb2_grpc.GatewayStub | None = None,
            cancel_when: Callable[[], bool] | None = None) -> Outcome:
        """Send `spec` and read it to its end; with `cancel_when`, cancel it once that says so
        before its first token (see run_request)."""
        with self._lock:
            self.sent.append(spec)
        self.progress.request_started()
        try:
            out = run_request(stub or self.stub_factory(), spec, self.timeout_s, self.progress, cancel_when)
        finally:
            self.progress.request_ended()
        with self._lock:
            self.outcomes.append(out)
        return out


def run_request(stub: gateway_pb2_grpc.GatewayStub, spec: RequestSpec, timeout_s: float, progress: Progress,
                cancel_when: Callable[[], bool] | None = None) -> Outcome:
    """Send one Generate and read it to its end (or to our cancel); never raises for the call.
    `cancel_when` (polled until the call ends) cancels the call once it answers True, before a chunk is read."""
    out = Outcome(spec, "OK", started_s=progress.elapsed_s())
    request = gateway_pb2.GenerateRequest(request_id=spec.request_id, prompt=ALL_PROMPTS[spec.prompt],
                                          sampling=common_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0))
    call = stub.Generate(request, timeout=timeout_s)
    try:
        if cancel_when is not None:
            _cancel_before_first_chunk(call, cancel_when, timeout_s)
        elif spec.cancel_after == 0:
            call.cancel()
        for i, chunk in enumerate(call):
            _record(out, chunk, progress)
            if spec.cancel_after is not None and i + 1 >= spec.cancel_after:
                call.cancel()
                break
    except grpc.RpcError as err:
        ours = spec.cancel_after is not None and err.code() == grpc.StatusCode.CANCELLED
        out.status, out.details = ("CANCELLED", "") if ours else (err.code().name, err.details() or "")
    else:
        if spec.cancel_after is not None and not out.finish_reasons:
            out.status = "CANCELLED"
    out.ended_s = progress.elapsed_s()
    return out


def _cancel_before_first_chunk(call: grpc.Future, cancel_when: Callable[[], bool], deadline_s: float) -> None:
    """Cancel `call` once `cancel_when()` holds (each poll is one Stats RPC, so this does not spin),
    unless the call ended first; the deadline (the request's own) bounds a stack that never answers."""
    deadline = time.monotonic() + deadline_s
    while not call.done() and time.monotonic() < deadline:
        if cancel_when():
            call.cancel()
            return


def _record(out: Outcome, chunk: gateway_pb2.GenerateResponse, progress: Progress) -> None:
    progress.add_tokens(len(chunk.token_ids))
    out.after_finish += bool(out.finish_reasons)
    out.tokens.extend(chunk.token_ids)
    if chunk.finish_reason:
        out.finish_reasons.append(chunk.finish_reason)
    if chunk.request_id != out.spec.request_id:
        out.foreign_ids += 1
