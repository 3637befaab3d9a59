"""Scheduler: picks the sequences of the next engine step under a token budget.

Running sequences go first (a decode is one token; an unfinished chunked prefill takes
what the budget leaves), then waiting sequences are admitted while blocks, batch slots
and budget last. Out of blocks, the newest running sequence is preempted by recompute:
its blocks are freed and it waits again (its full blocks usually stay cached, so the
recompute mostly hits the prefix cache).

With a draft proposer (speculative decoding, `pdserve.runtime.speculative`), a decoding sequence
may run its last token plus draft tokens as one chunk, while few sequences run and the budget and
free blocks allow it: a draft never preempts anyone.

A waiting sequence holds no blocks. Admitting one allocates all its blocks at once, bringing in
the KV it carries from elsewhere (`Sequence.external`): the loads go out in the SchedulerOutput
for the engine to copy before the step runs, the way vLLM's scheduler asks its KV connector for
external matches and hands it the blocks it allocated. A sequence the cache cannot take yet
first makes the prefetch holds give way (`PinTable.give_up`): a prompt that runs now beats a
predicted turn.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.runtime import engine_metrics
from pdserve.runtime.block_manager import BlockLoad, BlockManager
from pdserve.runtime.config import SchedulerConfig
from pdserve.runtime.pins import PinTable
from pdserve.runtime.sequence import Sequence, SequenceStatus
from pdserve.runtime.speculative import NgramProposer


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step (query length), the draft's included
    draft: tuple[int, ...] = ()  # speculative tokens after the last one, verified by this step

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so its logits pick the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly running this step
    loads: list[BlockLoad] = field(default_factory=list)  # KV from elsewhere to copy in first

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, pins: PinTable | None = None,
                 proposer: NgramProposer | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.pins = pins  # holds that give way to an admission short of blocks
        self.proposer = proposer  # drafts for speculative decoding; None: off
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
            draft = self._draft(seq, n, budget)
            if draft:  # the last token and the draft as one chunk: the chunked-prefill path
                out.prefills.append(ScheduledSeq(seq, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                i += 1
                continue
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

    def _draft(self, seq: Sequence, n: int, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decoding `seq`, their slots taken; () when it does not speculate now."""
        spec = self.proposer
        if spec is None or n != 1 or seq.num_tokens - seq.num_computed_tokens != 1 \
                or not spec.allows(len(self.running) + len(self.waiting)):
            return ()
        # Past max_tokens a draft could only be cut: the last emitted token is always a drawn one.
        draft = spec.propose(seq, min(budget - 1, seq.params.max_tokens - len(seq.output_ids) - 1))
        if not draft:
            return ()
        extra = self.blocks.blocks_for(seq.num_computed_tokens + 1 + len(draft)) - len(seq.block_table)
        # Headroom of a block per running sequence, so that a guess never makes anyone wait or preempt.
        if extra > 0 and self.blocks.num_free_blocks - extra < len(self.running):
            return ()
        if not self.blocks.ensure_slots(seq, seq.num_computed_tokens + 1 + len(draft)):
            return ()
        return draft

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            loads = self.blocks.allocate(seq)
            if loads is None and self.pins is not None and self.pins.has_holds() and \
                    self.pins.give_up(self.blocks.shortfall(seq)):
                loads = self.blocks.allocate(seq)
            if loads is None:
                break  # the head waits for blocks; admitting others first could starve it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.loads.extend(loads)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            (out.decodes if n == 1 else out.prefills).append(ScheduledSeq(seq, n))
            budget -= n

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
        engine_metrics.count_preemptions()

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
