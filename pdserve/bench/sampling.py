"""How every benchmark request samples: greedy by default, or as a chat client does (temperature,
top-p, top-k, min-p), the same fields to pdserve's gRPC API and to any OpenAI-compatible server.

Sampled requests carry a seed each (derived from the run's seed and the request's id), so a run is
reproducible where the server honours seeds (pdserve, vLLM, llama.cpp server). Output lengths stay
the workload's either way: every request asks for `ignore_eos`. The filters are sent even at their
"off" values, so that a server with filters of its own by default (llama.cpp server: top_k 40,
min_p 0.05) samples as asked. Servers differ in order: vLLM and pdserve apply the temperature first,
llama.cpp server's default chain applies top-p and min-p to the untempered distribution.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSampling:
    temperature: float = 0.0  # 0: greedy, and nothing else is sent
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int = 0  # the run's; each request's is derived from it and its id

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0, top_p in (0, 1], top_k >= 0, min_p in [0, 1]: {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def fields(self, request_id: str) -> dict:
        """The request's sampling fields, as JSON names (OpenAI's, and vLLM's top_k / min_p)."""
        if self.greedy:
            return {"temperature": 0}
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "seed": self.request_seed(request_id)}

    def request_seed(self, request_id: str) -> int:
        """A 31-bit seed of the run's seed and the request's id (every server takes that range)."""
        return zlib.crc32(f"{self.seed}:{request_id}".encode()) & 0x7FFFFFFF
