"""The per-step memo of derived tensors (runtime.kernels.step_memo): a derivation is computed once per key
among a kind's last SLOTS keys, keys compared by the identity of their tensors."""

from __future__ import annotations

import torch

from pdserve.runtime.kernels import step_memo
from pdserve.runtime.kernels.step_memo import per_step


def _counted(kind: str, key: tuple, calls: list) -> object:
    def compute():
        calls.append(key)
        return object()
    return per_step(kind, key, compute)


def test_prompts_of_one_step_keep_their_derivations_across_layers():
    """Three prompts' tables alternating over 30 layers, as a prefill step of three prompts calls: each
    derivation is computed once (one slot a kind rebuilt all three at every layer)."""
    tables = [torch.tensor([i, i + 1]) for i in range(3)]
    calls: list = []
    values = [[_counted("test_prompts", (t, 200), calls) for t in tables] for _ in range(30)]
    assert len(calls) == 3
    assert all(layer == values[0] for layer in values)


def test_the_oldest_key_leaves_past_slots_and_equal_tensors_are_other_keys():
    calls: list = []
    keys = [(torch.tensor([i]),) for i in range(step_memo.SLOTS + 1)]
    for key in keys:
        _counted("test_slots", key, calls)
    _counted("test_slots", keys[-1], calls)  # still held
    assert len(calls) == step_memo.SLOTS + 1
    _counted("test_slots", keys[0], calls)  # evicted by the last: computed again
    assert len(calls) == step_memo.SLOTS + 2
    _counted("test_slots", (torch.tensor([1]),), calls)  # equal values, another tensor: a new step's
    assert len(calls) == step_memo.SLOTS + 3
