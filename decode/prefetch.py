"""BlockPrefetcher: gets the KV blocks a request needs onto this worker, early when hinted.

A Prepare hint (sent by the gateway before prefill starts) fetches the blocks that already
exist in the KV store into a bounded staging area, so that by the time Decode arrives only
the freshly prefilled blocks still have to move. Blocks already in this worker's paged
cache are never fetched. A block that fails its header or checksum check is dropped: the
engine then recomputes that request's prompt instead of decoding garbage.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pdserve.kvwire import KVBlockError, decode_block
from pdserve.worker_common import Worker

log = logging.getLogger(__name__)


class BlockPrefetcher:
    def __init__(self, worker: Worker, max_staged_blocks: int = 4096) -> None:
        self.worker = worker
        self.max_staged_blocks = max_staged_blocks
        self._staged: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # [L, 2, bs, KVH, D] each
        self._inflight: dict[bytes, asyncio.Future] = {}
        self.hits = 0  # blocks a Decode found staged or in flight thanks to a hint
        self.rejected = 0  # blocks that failed their wire checks

    def is_local(self, h: bytes) -> bool:
        return self.worker.engine.block_manager.lookup(h) is not None

    def prefetch(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """Starts fetching what is neither local nor staged; returns (local, fetching)."""
        wanted = [h for h in hashes if not self.is_local(h) and h not in self._staged and h not in self._inflight]
        if wanted:
            self._start_fetch(wanted, request_id="")
        return len(hashes) - len(wanted), len(wanted)

    async def gather(self, request_id: str, hashes: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        """The decoded blocks among `hashes` that are not in the paged cache already."""
        needed = [h for h in hashes if not self.is_local(h)]
        found: dict[bytes, torch.Tensor] = {}
        for h in needed:
            if h in self._inflight:
                await asyncio.shield(self._inflight[h])
            if h in self._staged:
                found[h] = self._staged.pop(h)
                self.hits += 1
        missing = [h for h in needed if h not in found]
        if missing:
            found.update(await self._fetch(missing, request_id))
        return found

    def _start_fetch(self, hashes: list[bytes], request_id: str) -> None:
        task = asyncio.ensure_future(self._fetch_and_stage(hashes, request_id))
        for h in hashes:
            self._inflight[h] = task

    async def _fetch_and_stage(self, hashes: list[bytes], request_id: str) -> None:
        try:
            blocks = await self._fetch(hashes, request_id)
        except Exception as exc:  # noqa: BLE001 - a hint must never fail a request
            log.warning("prefetch of %d blocks failed: %s", len(hashes), exc)
            blocks = {}
        finally:
            for h in hashes:
                self._inflight.pop(h, None)
        for h, t in blocks.items():
            self._staged[h] = t
        while len(self._staged) > self.max_staged_blocks:
            self._staged.popitem(last=False)

    async def _fetch(self, hashes: list[bytes], request_id: str) -> dict[bytes, torch.Tensor]:
        datas = await self.worker.kv.get_blocks(hashes, request_id)
        self.worker.counters.kv_bytes_received += sum(len(d) for d in datas if d)
        return await asyncio.to_thread(self._decode_all, hashes, datas)

    def _decode_all(self, hashes: list[bytes], datas: list[bytes | None]) -> dict[bytes, torch.Tensor]:
        out = {}
        for h, data in zip(hashes, datas):
            if data is None:
                continue
            try:
                out[h], _ = decode_block(data, self.worker.spec)
            except KVBlockError as exc:
                self.rejected += 1
                log.warning("KV block %s rejected (%s): the request will recompute it", h.hex()[:12], exc)
        return out
