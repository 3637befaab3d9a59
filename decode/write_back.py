"""BlockWriteBack: a decoding sequence's KV blocks go to the kvstore as they fill, in batches.

Why as they fill and not only at the end: when this decode worker dies mid-stream, the gateway
resumes the request on another decode worker, which finds the prompt and every generated block
written so far by prefix lookup and recomputes only the unwritten tail. The next turn of a
conversation (prompt = this prompt + this answer) finds them the same way.

Newly full blocks go into the worker's one `WriteBackQueue`, whose single background task writes
what has accumulated: one export from the paged cache and one put stream for all of them, whichever
sequences filled them. A write starts once BATCH_BLOCKS blocks wait, when a sequence ends (its last
blocks go at once: a next turn may follow at once) or a handover flushes, or MAX_WAIT_S after the
oldest waiting block (what a crash can cost a resume: a recompute of that much). The token stream
never waits for it, and a failed write is only logged (`KVOutage`, once per outage). Why batches: at
32 streams a block fills about every other step; a presence check, an engine-thread hop and a put
stream per block cost 7-9 % of a 32-stream run's throughput (SmolLM2, 2 cores) against the write-back
off, and writes started back to back still carried 1-2 blocks each (a put call costs the kvstore about
0.5 ms and 0.4 ms more a block). Waiting for a batch: +4-5 % tok/s at bench-stack's decode-heavy
default workload (three alternating pairs), the kvstore's CPU a quarter less.

What the store holds already is not sent again. A request the prefill worker prefilled names the
prompt blocks it put (`stored`): those are never queued (were its put refused, whoever needs them
next recomputes them, as after a failed write-back), and the generated ones are put without
asking first (the store keeps one copy of a block sent twice, as when the same prompt was answered
the same way before). Why not ask: a Lookup round trip a write cost the kvstore a fifth of its CPU
at 32 streams, and its answer for a block this sequence just generated is almost always "absent"
(32 streams, SmolLM2, three alternating pairs: 397 / 386 / 368 against 411 / 398 / 402 tok/s). A
sequence prefilled here (`stored` None: a resume, or no prefill worker) may have found any of its
prompt blocks in the store or in the paged cache, so its blocks are looked up before any data
moves. Either way every block is considered once.

A stream handed over by a draining worker (pdserve.drain) waits for its writes in flight (`flush`)
before it ends: the worker that resumes it then finds every full block instead of recomputing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Coroutine, Sequence

from pdserve.worker_common import Worker, put_blocks

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine], asyncio.Future]  # runs a coroutine as a task of its own
BATCH_BLOCKS = 16  # waiting blocks that start a write at once
MAX_WAIT_S = 0.5  # the longest a filled block waits for others: what a crash can cost a resume


class WriteBackQueue:
    """The worker's blocks waiting to be written back, written by one background task at a time.

    A write starts when `batch_blocks` blocks wait, when a sequence ends or a handover flushes
    (`write_now`), or `max_wait_s` after the oldest waiting block, whichever comes first; it takes
    everything waiting then."""

    def __init__(self, worker: Worker, spawn: Spawn, batch_blocks: int = BATCH_BLOCKS,
                 max_wait_s: float = MAX_WAIT_S) -> None:
        self.worker = worker
        self._spawn = spawn
        self.batch_blocks = batch_blocks
        self.max_wait_s = max_wait_s
        self._waiting: list[tuple[BlockWriteBack, list[bytes], asyncio.Future]] = []
        self._due = False  # the waiting blocks should go out now
        self._timer: asyncio.TimerHandle | None = None
        self._writer: asyncio.Future | None = None
        self.writes = 0  # export + put rounds done (each for every block waiting then)
        self.lookups = 0  # presence checks among them (only for sequences that prefilled here)

    @property
    def idle(self) -> bool:
        """Nothing waits and no write is in flight."""
        return not self._waiting and (self._writer is None or self._writer.done())

    def add(self, writer: BlockWriteBack, hashes: list[bytes]) -> asyncio.Future:
        """Queue `writer`'s new full blocks; the future ends when the write holding them has."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((writer, hashes, done))
        if sum(len(hs) for _, hs, _ in self._waiting) >= self.batch_blocks:
            self.write_now()
        else:
            self._start_timer()
        return done

    def write_now(self) -> None:
        """Start writing everything waiting (after the write in flight, if one is)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting:
            return
        self._due = True
        if self._writer is None or self._writer.done():
            self._writer = self._spawn(self._write_while_due())

    async def _write_while_due(self) -> None:
        while self._due and self._waiting:
            self._due = False
            batch, self._waiting = self._waiting, []
            try:
                await self._write(batch)
            finally:
                for _, _, done in batch:
                    if not done.done():
                        done.set_result(None)
        if self._waiting:  # blocks that came during the write, not due yet
            self._start_timer()

    def _start_timer(self) -> None:
        """The oldest waiting block's deadline, unless one runs already."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self.write_now)

    async def _write(self, batch: list[tuple[BlockWriteBack, list[bytes], asyncio.Future]]) -> None:
        worker = self.worker
        hashes = list(dict.fromkeys(h for _, hs, _ in batch for h in hs))  # in order, each once
        unknown = list(dict.fromkeys(h for w, hs, _ in batch if w.stored is None for h in hs))
        self.writes += 1
        try:
            present: set[bytes] = set()
            if unknown:
                self.lookups += 1
                present = {h for h, p in zip(unknown, await worker.kv.presence(unknown)) if p}
            wanted = [h for h in hashes if h not in present]
            if not wanted:
                return
            blocks = await worker.aengine.export_cached(wanted)
            await put_blocks(worker, "", blocks)
            worker.kv_outage.ok()
            exported = {b.hash for b in blocks}
            for writer, hs, _ in batch:
                writer.written += sum(h in exported for h in hs)
        except Exception as exc:  # noqa: BLE001 - write-back only helps later requests
            worker.kv_outage.failed(f"write-back of {', '.join(sorted({w.request_id for w, _, _ in batch}))}", exc)


class BlockWriteBack:
    """Follows one sequence's tokens: `extend` with each chunk's tokens, the last one included.
    `stored`: hashes of blocks the store holds (the prompt blocks the prefill worker put), never
    queued; the others are then put without a presence check. None: the store is asked first."""

    def __init__(self, queue: WriteBackQueue, request_id: str, tokens: Sequence[int],
                 stored: Collection[bytes] | None = None) -> None:
        self.worker = queue.worker
        self.stored = None if stored is None else frozenset(stored)
        self.request_id = request_id
        self.tokens = list(tokens)  # prompt and generated tokens; the last one has no KV yet
        self.chain: list[bytes] = []  # hashes of the full blocks considered so far, in order
        self._queue = queue
        self.written = 0  # blocks of this sequence the queue put into the store
        self._pending: set[asyncio.Future] = set()  # writes in flight holding its blocks

    def extend(self, new_tokens: Sequence[int], last: bool = False) -> None:
        """Record generated tokens; queues the blocks they completed for writing in the background.
        `last`: the sequence ended, its blocks go out now (a next turn may follow at once)."""
        self.tokens.extend(new_tokens)
        new = self._new_full_blocks()
        if new:
            done = self._queue.add(self, new)
            self._pending.add(done)
            done.add_done_callback(self._pending.discard)
        if last and self._pending:
            self._queue.write_now()

    async def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the puts in flight; whether they all ended. They go on
        after a timeout, and a failed one is only logged, as ever."""
        if not self._pending:
            return True
        self._queue.write_now()
        _, pending = await asyncio.wait(set(self._pending), timeout=timeout_s)
        return not pending

    def _new_full_blocks(self) -> list[bytes]:
        fmt = self.worker.kv_format
        bs = fmt.block_size
        full = fmt.reusable_blocks(len(self.tokens))  # the last token's KV is not computed yet
        start = len(self.chain)
        for i in range(start, full):
            parent = self.chain[-1] if self.chain else None
            self.chain.append(fmt.block_hash(parent, self.tokens[i * bs:(i + 1) * bs]))
        new = self.chain[start:]
        return new if self.stored is None else [h for h in new if h not in self.stored]
