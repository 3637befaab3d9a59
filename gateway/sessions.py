"""Predictive prefetch signals the gateway decides: session prediction and hot prefixes.

Session prediction (requests with a session_id): a conversation comes back with the same prefix
(the last turn's prompt and answer, which the decode worker wrote back to the kvstore). For each
session the tracker learns the think time, an EWMA of the gaps between a turn's end and the next
turn's arrival, and its mean deviation (as TCP estimates a round trip); a session that has not
shown a gap yet borrows the estimate of all sessions. `due()` names the sessions whose next turn
is expected within the lead time, lead_s (the time the blocks take to move) + max(lead_fraction x
think time, deviation_factor x deviation): irregular sessions are prefetched earlier, and a
deviation factor of 3 covers all but a few percent of arrivals (the estimate's own error included):
the gateway then sends Prepare(signal="session") to the session's prefill worker and to its decode
worker, which pull the blocks (promoting them from Redis to the kvstore's memory on the way) into
their paged caches: the next turn's prefill then computes only the new tokens, without waiting for
its history to move (that wait is on the TTFT), and its decode finds the history resident. A session
that stays quiet for `give_up_factor` think times is given up (no more prefetches until it
speaks again); one idle for `forget_after_s` is forgotten. Memory is bounded whatever clients
send: at most `max_sessions` sessions and `max_blocks` block hashes over all of them (a session
holds its whole history's hashes: up to context window / block size), the least recently active
dropped first; session ids are at most --max-id-chars (checked at the edge).

Counting: a prediction that had not fired when the turn arrived counts its blocks as
outcome="late" here; blocks actually fetched are counted by the decode worker (hit when a Decode
uses them, wasted when evicted unused), so no block is counted twice.

Hot prefixes: leading block chains seen in at least `min_requests` requests within `window_s`
are hot; `HotPrefixes.targets` names the decode workers that do not hold one yet (from the
kvstore's residency answer), at most once per worker and chain every `resend_s`.

Pure Python with an injected clock: the gateway's event loop calls it, tests drive it.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.metrics import PREFETCH_BLOCKS


@dataclass(frozen=True, slots=True)
class SessionPrefetch:
    """Prefetch this session's blocks onto its decode worker now."""

    session_id: str
    worker: str  # decode worker address
    block_hashes: tuple[bytes, ...]
    prefill_worker: str = ""  # the prefill worker of its last turn ("" if prefilled on decode)


@dataclass(slots=True)
class _Gaps:
    """EWMA of think times and of their absolute deviation (as TCP estimates round trips)."""

    mean: float | None = None
    dev: float = 0.0

    def add(self, gap: float, alpha: float) -> None:
        if self.mean is None:
            # No spread known yet: the lead is then lead_s + lead_fraction x gap. A guessed
            # spread (TCP starts at half the first sample) fired most predictions right at the
            # turn's end, and blocks waiting that long were evicted by other sessions' turns.
            self.mean, self.dev = gap, 0.0
        else:
            self.dev = alpha * abs(gap - self.mean) + (1 - alpha) * self.dev
            self.mean = alpha * gap + (1 - alpha) * self.mean


@dataclass(slots=True)
class _Session:
    worker: str = ""
    prefill_worker: str = ""
    block_hashes: tuple[bytes, ...] = ()
    last_end: float | None = None
    gaps: _Gaps = field(default_factory=_Gaps)  # this session's think times; mean None until one gap
    in_turn: bool = False
    prefetched: bool = False  # the prefetch for the upcoming turn was sent
    given_up: bool = False


class SessionTracker:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, alpha: float = 0.3,
                 lead_s: float = 0.5, lead_fraction: float = 0.2, deviation_factor: float = 3.0,
                 give_up_factor: float = 3.0, forget_after_s: float = 600.0,
                 max_sessions: int = 100_000, max_blocks: int = 1_000_000) -> None:
        self._clock = clock
        self.alpha = alpha  # weight of the newest gap in the EWMAs
        self.lead_s = lead_s  # the time the blocks take to land: always added to the margin
        self.lead_fraction = lead_fraction  # margin: this fraction of the think time ...
        self.deviation_factor = deviation_factor  # ... or this many mean deviations, if longer
        self.give_up_factor = give_up_factor
        self.forget_after_s = forget_after_s
        self.max_sessions = max_sessions
        self.max_blocks = max_blocks  # ~50 MB of hashes
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently active first
        self._blocks = 0  # block hashes held over all sessions
        # Every session's gaps: the prior for a session that has not shown one yet, so that its
        # second turn is predicted too (people think about as long as other people do).
        self._population = _Gaps()

    def arrival(self, session_id: str) -> str:
        """A turn of `session_id` arrives; returns the decode worker it last ran on ("" if none)."""
        now = self._clock()
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = _Session()
            self._trim()
        self._sessions.move_to_end(session_id)
        if s.last_end is not None and not s.in_turn:
            gap = max(now - s.last_end, 0.0)
            if self._gaps(s) is not None and not s.prefetched and not s.given_up and s.block_hashes:
                PREFETCH_BLOCKS.labels(signal="session", outcome="late").inc(len(s.block_hashes))
            s.gaps.add(gap, self.alpha)
            self._population.add(gap, self.alpha)
        s.in_turn, s.prefetched, s.given_up = True, False, False
        return s.worker

    def prefill_home(self, session_id: str) -> str:
        """The prefill worker of the session's last turn ("" if none): its paged cache has the
        session's prompt, and the session prefetch brings the answer there too."""
        s = self._sessions.get(session_id)
        return s.prefill_worker if s is not None else ""

    def finished(self, session_id: str, worker: str, block_hashes: Sequence[bytes],
                 prefill_worker: str = "") -> None:
        """The turn ended on `worker` (decode) after `prefill_worker` computed its prompt;
        `block_hashes`: the full blocks of its prompt and answer."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        self._blocks += len(block_hashes) - len(s.block_hashes)
        s.worker, s.block_hashes = worker, tuple(block_hashes)
        s.prefill_worker = prefill_worker
        s.last_end, s.in_turn = self._clock(), False
        self._trim()

    def predicted_arrival(self, session_id: str) -> float | None:
        s = self._sessions.get(session_id)
        gaps = self._gaps(s) if s is not None else None
        if s is None or s.last_end is None or gaps is None:
            return None
        return s.last_end + gaps.mean

    def due(self) -> list[SessionPrefetch]:
        """Sessions to prefetch now (each at most once per turn); gives up on quiet ones."""
        now = self._clock()
        plans = []
        for sid in list(self._sessions):
            s = self._sessions[sid]
            if s.last_end is not None and now - s.last_end > self.forget_after_s and not s.in_turn:
                self._forget(sid)
                continue
            gaps = self._gaps(s)
            if s.in_turn or s.prefetched or s.given_up or gaps is None or not s.block_hashes:
                continue
            if now > s.last_end + self.give_up_factor * max(gaps.mean, self.lead_s):
                s.given_up = True  # quiet: prefetching now would most likely be wasted
                continue
            if now >= s.last_end + gaps.mean - self._lead(gaps):
                s.prefetched = True
                plans.append(SessionPrefetch(sid, s.worker, s.block_hashes, s.prefill_worker))
        return plans

    def _lead(self, gaps: _Gaps) -> float:
        """How long before the predicted arrival to prefetch: irregular sessions earlier."""
        return self.lead_s + max(self.lead_fraction * gaps.mean, self.deviation_factor * gaps.dev)

    def _gaps(self, s: _Session) -> _Gaps | None:
        """The session's own think-time estimate, else the population's, None before any gap."""
        if s.gaps.mean is not None:
            return s.gaps
        return self._population if self._population.mean is not None else None

    def _trim(self) -> None:
        while self._sessions and (len(self._sessions) > self.max_sessions or self._blocks > self.max_blocks):
            self._forget(next(iter(self._sessions)))

    def _forget(self, session_id: str) -> None:
        self._blocks -= len(self._sessions.pop(session_id).block_hashes)


@dataclass(slots=True)
class _Chain:
    seen: deque[float] = field(default_factory=deque)
    sent: dict[str, float] = field(default_factory=dict)  # worker id -> when it was last told


class HotPrefixes:
    """Counts leading block chains; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, min_requests: int = 4,
                 window_s: float = 60.0, chain_blocks: int = 8, min_blocks: int = 2,
                 resend_s: float = 30.0, max_chains: int = 10_000) -> None:
        self._clock = clock
        self.min_requests = min_requests
        self.window_s = window_s
        self.chain_blocks = chain_blocks  # the prefix considered: at most this many leading blocks
        self.min_blocks = min_blocks  # shorter prompts are not worth it
        self.resend_s = resend_s
        self.max_chains = max_chains
        self._chains: OrderedDict[tuple[bytes, ...], _Chain] = OrderedDict()

    def observe(self, block_hashes: Sequence[bytes]) -> tuple[bytes, ...] | None:
        """Count a request's prefix; returns the chain when it is hot."""
        chain = tuple(block_hashes[:self.chain_blocks])
        if len(chain) < self.min_blocks:
            return None
        now = self._clock()
        record = self._chains.get(chain)
        if record is None:
            record = self._chains[chain] = _Chain()
            while len(self._chains) > self.max_chains:
                self._chains.popitem(last=False)
        self._chains.move_to_end(chain)
        record.seen.append(now)
        while record.seen and record.seen[0] < now - self.window_s:
            record.seen.popleft()
        return chain if len(record.seen) >= self.min_requests else None

    def targets(self, chain: tuple[bytes, ...], workers: Sequence[str], resident: Mapping[str, int]) -> list[str]:
        """Worker ids that should be sent the hot `chain` now (and are marked as told)."""
        record = self._chains.get(chain)
        if record is None:
            return []
        now = self._clock()
        out = []
        for w in workers:
            if not w or resident.get(w, 0) >= len(chain):
                continue
            if now - record.sent.get(w, -float("inf")) < self.resend_s:
                continue
            record.sent[w] = now
            out.append(w)
        return out
