"""BlockWriteBack: a decoding sequence's KV blocks go to the kvstore as soon as they fill.

Why as they fill and not only at the end: when this decode worker dies mid-stream, the gateway
resumes the request on another decode worker, which finds the prompt and every generated block
written so far by prefix lookup and recomputes only the unwritten tail. The next turn of a
conversation (prompt = this prompt + this answer) finds them the same way.

Each newly full block is exported from the paged cache and put, unpinned, in a background task:
the token stream never waits for it, and a failed put is only logged (`KVOutage`, once per
outage). Blocks the store already holds (the prompt, put by prefill) are skipped by a presence
check before any data moves; every block is considered once, so nothing is sent twice.

A stream handed over by a draining worker (pdserve.drain) waits for its puts in flight (`flush`)
before it ends: the worker that resumes it then finds every full block instead of recomputing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence

from pdserve.worker_common import Worker, put_blocks

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine], asyncio.Future]  # runs a coroutine as a task of its own


class BlockWriteBack:
    """Follows one sequence's tokens: `extend` with each chunk's tokens, the last one included."""

    def __init__(self, worker: Worker, request_id: str, tokens: Sequence[int], spawn: Spawn) -> None:
        self.worker = worker
        self.request_id = request_id
        self.tokens = list(tokens)  # prompt and generated tokens; the last one has no KV yet
        self.chain: list[bytes] = []  # hashes of the full blocks considered so far, in order
        self._spawn = spawn
        self.written = 0  # blocks this sequence put into the store (stored or already present)
        self._pending: set[asyncio.Future] = set()  # puts in flight

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Record generated tokens; puts the blocks they completed in the background."""
        self.tokens.extend(new_tokens)
        new = self._new_full_blocks()
        if new:
            task = self._spawn(self._put(new))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the puts in flight; whether they all ended. They go on
        after a timeout, and a failed one is only logged, as ever."""
        if not self._pending:
            return True
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
        return self.chain[start:]

    async def _put(self, hashes: list[bytes]) -> None:
        worker = self.worker
        try:
            present = await worker.kv.presence(hashes)
            wanted = [h for h, p in zip(hashes, present) if not p]
            if not wanted:
                return
            blocks = await worker.aengine.export_cached(wanted)
            await put_blocks(worker, "", blocks)
            worker.kv_outage.ok()
            self.written += len(blocks)
        except Exception as exc:  # noqa: BLE001 - write-back only helps later requests
            worker.kv_outage.failed(f"write-back of {self.request_id}", exc)
