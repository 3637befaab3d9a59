"""Resume bookkeeping (gateway.resume), the engine side of a resumed stream (greedy and seeded
sampling continue exactly where the lost worker was), and the prefill worker's single flight."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import STORIES_GGUF
from gateway.resume import MAX_RESUMES, StreamProgress
from pdserve.runtime.engine import AddRequest, Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from prefill.single_flight import SingleFlight

N = 40


@pytest.fixture(scope="module")
def engine_and_prompt():
    torch.set_num_threads(1)
    checkpoint = load_checkpoint(STORIES_GGUF)
    return Engine.from_checkpoint(checkpoint), checkpoint.tokenizer.encode("Once upon a time, a little fox")


def test_resume_point_continues_where_the_client_is() -> None:
    p = StreamProgress([1, 2, 3], SamplingParams(max_tokens=10, seed=5, stop=("x",)))
    assert p.resume_point().prompt_ids == [1, 2, 3] and p.resume_point().resumed_tokens == 0
    p.generated += [7, 8, 9, 10]
    point = p.resume_point()
    assert point.prompt_ids == [1, 2, 3, 7, 8, 9, 10] and point.resumed_tokens == 4
    assert point.sampling == SamplingParams(max_tokens=6, seed=5, stop=("x",))  # only max_tokens changes
    assert p.prompt_ids == [1, 2, 3]  # the original prompt is kept
    p.generated += [0] * 6
    assert p.resume_point() is None  # nothing left to generate
    p.lost += ["a"] * MAX_RESUMES
    assert p.may_resume()
    p.lost.append("b")
    assert not p.may_resume()


def _continue(engine: Engine, rid: str, prompt: list[int], delivered: list[int], params: SamplingParams,
              positioned: bool = True) -> list[int]:
    """What a worker resuming after `delivered` generates: Decode's local prefill of prompt +
    delivered (nothing imported), told how many tokens were delivered."""
    point = StreamProgress(prompt, params, list(delivered)).resume_point()
    seq = engine.add(AddRequest(rid, point.prompt_ids, point.sampling,
                                resumed_tokens=point.resumed_tokens if positioned else 0))
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=N, temperature=1.0, seed=1234, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_resumed_sequence_continues_the_stream(engine_and_prompt, params: SamplingParams) -> None:
    engine, prompt = engine_and_prompt
    [full] = engine.generate([prompt], params)
    out = full.output_ids
    for k in (1, 17, N - 1):  # right after prefill, mid-block, before the last token
        assert out[:k] + _continue(engine, f"resume-{k}-{params.greedy}", prompt, out[:k], params) == out
    engine.check_leaks()


def test_seeded_resume_needs_the_resumed_position(engine_and_prompt) -> None:
    """The control: without resumed_tokens the seeded continuation draws other tokens."""
    engine, prompt = engine_and_prompt
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=99, ignore_eos=True)
    [full] = engine.generate([prompt], params)
    assert _continue(engine, "unpositioned", prompt, full.output_ids[:10], params, positioned=False) \
        != full.output_ids[10:]


def test_single_flight_shares_one_run_per_key() -> None:
    async def scenario() -> None:
        flights: SingleFlight[int] = SingleFlight()
        runs = []
        gate = asyncio.Event()

        async def work(value: int) -> int:
            runs.append(value)
            await gate.wait()
            return value

        first = asyncio.ensure_future(flights.run("r1", lambda: work(1)))
        second = asyncio.ensure_future(flights.run("r1", lambda: work(2)))  # a retry: joins run 1
        other = asyncio.ensure_future(flights.run("r2", lambda: work(3)))
        await asyncio.sleep(0)
        first.cancel()  # one caller gone: the run goes on for the other
        await asyncio.sleep(0)
        gate.set()
        assert await second == 1 and await other == 3 and runs == [1, 3] and flights.joined == 1
        assert not flights.running("r1")

        gate.clear()
        lonely = asyncio.ensure_future(flights.run("r3", lambda: work(4)))
        await asyncio.sleep(0)
        lonely.cancel()  # every caller gone: the run is cancelled
        with pytest.raises(asyncio.CancelledError):
            await lonely
        for _ in range(3):  # the run's cancellation and done callback take a few loop turns
            await asyncio.sleep(0)
        assert not flights.running("r3") and runs == [1, 3, 4]

        async def fails() -> int:
            raise ValueError("bad prompt")
        with pytest.raises(ValueError, match="bad prompt"):
            await flights.run("r4", fails)
    asyncio.run(scenario())
