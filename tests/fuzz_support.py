"""What the fuzz modules share: the statuses a bad request may get, and the after-fuzzing check
that the stack still serves the reference output and leaked no KV anywhere.

Each fuzz module starts its own small real stack (1 prefill, 1 decode, kvstore, gateway), throws
generated input at it, and ends with `assert_still_healthy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings

from conftest import STORIES_GGUF
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.soak.invariants import kv_problems, wait_quiet
from pdserve.stack import Stack, start_stack
from pdserve.v1 import common_pb2, gateway_pb2

# What the gateway documents for a request it cannot serve as asked (service.py, limits.py,
# H7's input limits): never UNKNOWN or INTERNAL, and on a healthy stack never UNAVAILABLE (that
# would mean the input took a worker down).
DOCUMENTED = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,  # a request_id reused while a cancelled call with it still winds down
})

# Derandomized: the same examples on every run, so CI failures reproduce.
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

REFERENCE_PROMPT = "Once upon a time"
REFERENCE_TOKENS = 16


def reference_ids() -> list[int]:
    """The in-process engine's greedy output for REFERENCE_PROMPT."""
    torch.set_num_threads(1)  # a tiny model: more threads only fight the stack's processes for the cores
    checkpoint = load_checkpoint(STORIES_GGUF)
    ids = checkpoint.tokenizer.encode(REFERENCE_PROMPT)
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, temperature=0)
    return Engine.from_checkpoint(checkpoint).generate([ids], params)[0].output_ids


def stack_fixture(*extra: str) -> Callable[[], Iterator[Stack]]:
    """A module-scoped fixture `stack`: 1 prefill, 1 decode, kvstore, gateway; `extra` up flags."""
    @pytest.fixture(scope="module")
    def stack() -> Iterator[Stack]:
        s = start_stack(1, 1, *extra)
        yield s
        s.stop()
    return stack


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """The reference output `assert_still_healthy` compares with (import it into the module)."""
    return reference_ids()


def stream_outcome(call, max_chunks: int = 4) -> tuple[grpc.StatusCode, str]:
    """Read up to `max_chunks` of a streaming call, then cancel it: (status, details); OK when
    the stream was fine so far."""
    try:
        for i, _ in enumerate(call):
            if i + 1 >= max_chunks:
                call.cancel()
                break
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED:
            return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def assert_documented(code: grpc.StatusCode, details: str, what: object) -> None:
    if code == grpc.StatusCode.OK:
        return
    assert code in DOCUMENTED, f"{code.name} ({details!r}) for {what!r}"
    assert details.strip(), f"{code.name} without a message for {what!r}"


def assert_still_healthy(stack: Stack, expected: list[int]) -> None:
    """Every process alive, a normal request returns the reference, no KV held anywhere."""
    dead = [c.spec.name for c in [*stack.workers, stack.gateway] if c.proc.poll() is not None]
    assert not dead, f"processes died while fuzzing: {dead}"
    request = gateway_pb2.GenerateRequest(prompt=REFERENCE_PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=REFERENCE_TOKENS, temperature=0))
    got = [t for chunk in stack.gateway_stub().Generate(request, timeout=60) for t in chunk.token_ids]
    assert got == expected
    problems = kv_problems(wait_quiet(stack, timeout_s=30))
    assert not problems, problems
