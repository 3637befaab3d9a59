"""Scheduler: picks the sequences of the next engine step under a token budget.

Running sequences go first (a decode is one token; an unfinished chunked prefill takes
what the budget leaves), then waiting sequences are admitted while blocks, batch slots
and budget last. Out of blocks, the newest running sequence is preempted by recompute:
its blocks are freed and it waits again (its full blocks usually stay cached, so the
recompute mostly hits the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.runtime.block_manager import BlockManager
from pdserve.runtime.config import SchedulerConfig
from pdserve.runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step (query length)

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so its logits pick the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    return budget
            if n == 1:  # one query token: the batched paged-decode path
                out.decodes.append(ScheduledSeq(seq, 1))
            else:
                out.prefills.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._admission_slots(seq, budget)
            # Only when nothing runs: a running sequence frees its blocks when it ends, and taking
            # the others' prefixes costs them a recompute whenever the head then evicts them.
            if n is None and not self.running and self._unpin_waiting(seq):
                n = self._admission_slots(seq, budget)  # retry with the blocks the others held
            if n is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            (out.decodes if n == 1 else out.prefills).append(ScheduledSeq(seq, n))
            budget -= n

    def _admission_slots(self, seq: Sequence, budget: int) -> int | None:
        """Tokens of `seq` this step computes, its blocks taken; None when the cache is short."""
        if not seq.block_table and not self.blocks.allocate(seq):
            return None
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
            return None  # an imported sequence whose next token needs a block we lack
        return n

    def _unpin_waiting(self, head: Sequence) -> bool:
        """Releases the blocks that sequences waiting behind `head` hold (prefixes imported when
        they were added); True if any did. Without this, waiting sequences holding the whole
        cache with nothing running deadlock the engine. Their blocks stay cached by hash, so
        `allocate` finds them again when their turn comes (unless evicted by then: recomputed)."""
        released = False
        for seq in self.waiting:
            if seq is head or not seq.block_table:
                continue
            self._drop_blocks(seq)
            released = True
        return released

    def _drop_blocks(self, seq: Sequence) -> None:
        """`seq` gives its blocks back and starts over (what it had cached is found again by hash)."""
        self.blocks.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.block_hashes = []

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.decodes = [s for s in out.decodes if s.seq is not seq]
        out.prefills = [s for s in out.prefills if s.seq is not seq]
        self._drop_blocks(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Ends `seq` (finished or aborted) and returns its blocks unless told to keep them."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_blocks:
            self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
