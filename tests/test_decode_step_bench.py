"""benchmarks/decode_step.py: its timed steps decode the whole batch, however long the prompts.

Before stop 51 the sequences' max_tokens was the timed steps plus 8, while the first prompts of a
chunked prefill already decoded a token at every later prefill step: at 32 sequences of 264-token
prompts some finished inside the timed window, so "a step at 32" was a step of fewer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_step  # noqa: E402


@pytest.fixture(scope="module")
def stories():
    return load_checkpoint(STORIES_GGUF, dtype=torch.float32)


def _engine(checkpoint, batch: int, prompt_len: int, steps: int, budget: int) -> Engine:
    scheduler = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget)
    longest = prompt_len + decode_step.prefill_steps(batch, prompt_len, scheduler) + steps + 8
    return Engine.from_checkpoint(checkpoint, EngineConfig(
        cache=CacheConfig(num_blocks=batch * (-(-longest // 16) + 1)), scheduler=scheduler))


@pytest.mark.parametrize("batch, prompt_len, budget", [(8, 120, 64), (3, 40, 512), (1, 200, 32)])
def test_every_timed_step_decodes_the_whole_batch(stories, batch: int, prompt_len: int, budget: int) -> None:
    """Chunked prefills of up to 15 steps before 5 timed ones: every timed step still decodes `batch`
    sequences (step_ms raises otherwise), and the engine is idle afterwards."""
    engine = _engine(stories, batch, prompt_len, steps=5, budget=budget)
    sizes: list[int] = []
    step = engine.step

    def counted():
        outputs = step()
        sizes.append(sum(bool(o.new_token_ids) for o in outputs))
        return outputs

    engine.step = counted
    assert decode_step.step_ms(engine, batch, 5, prompt_len) > 0
    assert sizes[-5:] == [batch] * 5
    assert not engine.has_unfinished() and not engine.seqs
    engine.check_leaks()


def test_a_timed_step_of_fewer_sequences_is_an_error(stories) -> None:
    """A sequence that ends inside the window (here: an EOS it was not told to ignore cannot happen,
    so one is aborted by the engine's caller mid-run) fails the run instead of timing a smaller batch."""
    engine = _engine(stories, 4, 30, steps=5, budget=512)
    step, calls = engine.step, [0]

    def abort_one_in_the_window():
        calls[0] += 1
        if calls[0] == 6:  # prefill (1 step), 3 warm-ups, then the first timed step; this is the second
            engine.abort("b4-0")
        return step()

    engine.step = abort_one_in_the_window
    with pytest.raises(RuntimeError, match="decoded 3 sequences, not 4"):
        decode_step.step_ms(engine, 4, 5, 30)
