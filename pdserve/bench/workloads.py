"""Workloads: what `pdserve bench` sends, as conversations of one or more turns.

Every workload is a list of `Conversation`s. A plain request is a one-turn conversation; a session
(the `sessions` workload) has several turns sent one after another with think time between them,
each turn's prompt being the previous turn's prompt, plus its answer, plus the new user text, and
every turn carries the conversation's `session_id` (so the gateway can predict and prefetch).

Prompts are text, built from random token ids of the served model's vocabulary (the byte-fallback
and control ids are skipped so the text is ordinary word pieces); the gateway re-tokenizes them, so
prompt lengths are close to, not exactly, the requested ones: the report uses the lengths the
gateway reports back. Output lengths are exact: requests are greedy with ignore_eos.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

WORKLOADS = ("random", "shared-prefix", "sessions", "file")
FIRST_WORD_ID = 259  # llama sentencepiece: 0-2 control, 3-258 byte fallback


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class Turn:
    text: str  # the first turn's whole prompt, or the user text a later turn appends
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    session: bool = False  # send session_id (multi-turn conversations)
    think_time_s: float = 0.0  # between a turn's answer and the next turn


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The knobs of every workload (the command's flags); unused ones are ignored."""

    name: str = "random"
    num_requests: int = 100
    input_len: int = 32
    output_len: int = 64
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    num_prefixes: int = 4
    prefix_len: int = 64
    turns: int = 3
    turn_len: int = 16
    think_time_s: float = 0.2
    dataset: str | None = None


def num_requests(conversations: Sequence[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)


def build(spec: WorkloadSpec, tokenizer: TextTokenizer, seed: int) -> list[Conversation]:
    """The conversations of `spec`, the same for the same seed."""
    rng = random.Random(seed)
    if spec.name == "random":
        return random_workload(spec, tokenizer, rng)
    if spec.name == "shared-prefix":
        return shared_prefix_workload(spec, tokenizer, rng)
    if spec.name == "sessions":
        return sessions_workload(spec, tokenizer, rng)
    if spec.name == "file":
        if not spec.dataset:
            raise ValueError("the file workload needs --dataset PATH (ShareGPT-style JSON)")
        return file_workload(Path(spec.dataset), spec, tokenizer, rng)
    raise ValueError(f"unknown workload {spec.name!r}: use one of {', '.join(WORKLOADS)}")


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


def random_text(tokenizer: TextTokenizer, rng: random.Random, num_tokens: int) -> str:
    ids = [rng.randrange(FIRST_WORD_ID, tokenizer.vocab_size) for _ in range(num_tokens)]
    return tokenizer.decode(ids).strip() or "Once"


def random_workload(spec: WorkloadSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Conversation]:
    return [Conversation(f"r{i}", (Turn(random_text(tokenizer, rng, sample_len(rng, spec.input_len, spec.range_ratio)),
                                         sample_len(rng, spec.output_len, spec.range_ratio)),))
            for i in range(spec.num_requests)]


def shared_prefix_workload(spec: WorkloadSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Conversation]:
    """`num_prefixes` long prefixes (think system prompts), each request one of them + its own suffix."""
    prefixes = [random_text(tokenizer, rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    out = []
    for i in range(spec.num_requests):
        suffix = random_text(tokenizer, rng, sample_len(rng, spec.input_len, spec.range_ratio))
        out.append(Conversation(f"p{i}", (Turn(f"{prefixes[i % len(prefixes)]} {suffix}",
                                                sample_len(rng, spec.output_len, spec.range_ratio)),)))
    return out


def sessions_workload(spec: WorkloadSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Conversation]:
    """ceil(num_requests / turns) conversations of `turns` turns (the last one may be shorter)."""
    out, left, i = [], spec.num_requests, 0
    while left > 0:
        n = min(spec.turns, left)
        turns = [Turn(random_text(tokenizer, rng, sample_len(rng, spec.input_len, spec.range_ratio)),
                      sample_len(rng, spec.output_len, spec.range_ratio))]
        turns += [Turn(" " + random_text(tokenizer, rng, sample_len(rng, spec.turn_len, spec.range_ratio)),
                       sample_len(rng, spec.output_len, spec.range_ratio)) for _ in range(n - 1)]
        out.append(Conversation(f"s{i}", tuple(turns), session=True, think_time_s=spec.think_time_s))
        left, i = left - n, i + 1
    return out


def file_workload(path: Path, spec: WorkloadSpec, tokenizer: TextTokenizer, rng: random.Random) -> list[Conversation]:
    """ShareGPT-style JSON: a list of {"conversations": [{"from": "human", "value": ...}, {"from":
    "gpt", "value": ...}, ...]}; the first human turn is the prompt and the length of the reply that
    follows it (in tokens) the output length. Also accepted: [{"prompt": ..., "output_len": N}].
    Entries are shuffled with the seed; `num_requests` of them are used."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [p for p in (_prompt_and_len(e, tokenizer, spec.output_len) for e in entries) if p is not None]
    if not pairs:
        raise ValueError(f"{path}: no usable entries (need a human turn, or a prompt)")
    rng.shuffle(pairs)
    return [Conversation(f"f{i}", (Turn(prompt, n),)) for i, (prompt, n) in enumerate(pairs[:spec.num_requests])]


def _prompt_and_len(entry: Any, tokenizer: TextTokenizer, default_len: int) -> tuple[str, int] | None:
    if not isinstance(entry, dict):
        return None
    if "prompt" in entry:
        prompt = str(entry["prompt"]).strip()
        return (prompt, int(entry.get("output_len") or default_len)) if prompt else None
    turns = entry.get("conversations") or entry.get("conversation") or []
    for k, turn in enumerate(turns):
        if turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
            reply = turns[k + 1].get("value", "") if k + 1 < len(turns) else ""
            n = len(tokenizer.encode(reply, add_bos=False)) if reply else default_len
            return str(turn["value"]).strip(), max(1, n)
    return None
