"""What every layer of one step derives from the step's tensors, derived once a step.

Every layer of a step passes the same step tensors (positions, slot mapping, block tables, context
lengths) and derives the same values from them: RoPE rows, block ids and offsets, the attention
mask, int64 copies for the C kernels. 30 layers x a few small ops each is a real share of a decode
step on a CPU, so the last derivations per kind are kept, keyed by the very tensor objects they came
from (held, so their ids cannot be reused; a new step brings new objects, so nothing stale is ever
returned). A kind keeps SLOTS of them, not one: a prefill step of several prompts derives per prompt
(its block table, its chunk), and with one slot each prompt's call evicted the previous prompt's
derivation, so every layer rebuilt every prompt's tables and scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SLOTS = 8  # derivations kept per kind: the prompts of a prefill step (2-3 of 200 tokens in 512)
_step_memo: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}


def per_step(kind: str, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    """`compute()`, or what it gave for the same `key` before (its tensors compared by identity), among
    the last SLOTS keys of `kind`. CPU only: a GPU step may refill static buffers in place (CUDA graphs),
    so it never reuses."""
    if key[0].device.type != "cpu":
        return compute()
    entries = _step_memo.setdefault(kind, [])
    for held, value in entries:
        if len(held) == len(key) and all(a is b or (type(a) is not torch.Tensor and a == b) for a, b in zip(held, key)):
            return value
    value = compute()
    entries.append((key, value))
    if len(entries) > SLOTS:
        del entries[0]
    return value
