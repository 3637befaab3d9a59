"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.runtime.structured_output import StructuredOutput

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_LOGIT_BIAS = 300  # entries; OpenAI's limit


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # drop tokens below min_p * p(max); 0 means off
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, applied by the detokenizer
    ignore_eos: bool = False
    logprobs: int = 0  # top alternatives to return per token; 0 means no logprobs
    # OpenAI's penalties, over the tokens generated so far (not the prompt), as vLLM applies them:
    # logit -= presence_penalty * (count > 0) + frequency_penalty * count
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    # (token id, bias in [-100, 100]) added to the logit; kept sorted by id, each id once
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None  # the output must match this (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS:  # NaN passes every comparison below; inf poisons the softmax
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")
        ordered = tuple(sorted((int(t), float(b)) for t, b in self.logit_bias))
        if len({t for t, _ in ordered}) < len(ordered):
            raise ValueError("logit_bias names a token id more than once")
        object.__setattr__(self, "logit_bias", ordered)  # one order, whatever the client's (equal params compare equal)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty (an empty one would end every output at once)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {min(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
