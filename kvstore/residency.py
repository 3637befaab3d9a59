"""Which decode worker holds which blocks in its paged cache, as the workers report it.

Each decode worker reports the full blocks that entered and left its cache since its last report
(about once a second); a worker the index does not know (new, or this kvstore restarted) is asked
for a full report. A worker silent for `ttl_s` is forgotten (it died or left). `prefixes` answers
the gateway's question "how many leading blocks of this prompt does each worker hold?".

Pure Python, called from the kvstore's event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _WorkerBlocks:
    seen_at: float
    hashes: set[bytes] = field(default_factory=set)


class ResidencyIndex:
    def __init__(self, ttl_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._workers: dict[str, _WorkerBlocks] = {}

    def report(self, worker_id: str, added: Iterable[bytes], removed: Iterable[bytes], reset: bool) -> bool:
        """Apply one worker's report; True when the index needs a full (reset) report from it."""
        if not worker_id:
            raise ValueError("worker_id is required")
        self._expire()
        record = self._workers.get(worker_id)
        if record is None and not reset:
            return True  # deltas against a state we never saw mean nothing
        if reset or record is None:
            record = self._workers[worker_id] = _WorkerBlocks(self._clock())
        record.seen_at = self._clock()
        record.hashes.difference_update(removed)
        record.hashes.update(added)
        return False

    def prefixes(self, hashes: Sequence[bytes]) -> list[tuple[str, int]]:
        """(worker id, leading hashes it holds) for workers holding at least one, most first."""
        self._expire()
        out = []
        for worker_id, record in self._workers.items():
            n = 0
            for h in hashes:
                if h not in record.hashes:
                    break
                n += 1
            if n:
                out.append((worker_id, n))
        out.sort(key=lambda item: (-item[1], item[0]))
        return out

    def workers(self) -> list[str]:
        self._expire()
        return sorted(self._workers)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        for worker_id in [w for w, r in self._workers.items() if r.seen_at < cutoff]:
            del self._workers[worker_id]
