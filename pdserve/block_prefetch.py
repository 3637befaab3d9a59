"""BlockPrefetcher: gets the KV blocks a request needs onto this worker, early when told to.

Used by both worker kinds. Three signals bring blocks here before a request asks for them
(PrepareRequest.signal):
  * dispatch (decode workers): the gateway routed a request here and prefill is running; the
    blocks that already exist in the kvstore are fetched into a bounded staging area, so that by
    the time Decode arrives only the freshly prefilled blocks still have to move.
  * session (both): a conversation's next turn is predicted soon; its blocks (promoted from
    Redis to the kvstore's memory by the very fetch) go into the paged cache as cached,
    shareable blocks: on the prefill worker that will compute the turn (so its TTFT does not
    wait for the history to move) and on the decode worker that will continue it.
  * hot (decode workers): a prefix many requests share; kept in the paged cache of every one.
Blocks already in the paged cache are never fetched. A block that fails its header or checksum
check, or (with a KV MAC key, `pdserve.kv_mac`) whose MAC does not verify for its hash, is dropped:
the engine then recomputes that request's prompt instead of decoding garbage or forged KV. Each
refusal is counted in pdserve_kv_blocks_rejected_total{reason} and logged, one line per fetch.

Every prefetched block is counted once in pdserve_prefetch_blocks_total{signal, outcome}:
hit (a request used it), late (a request needed it while it was still on its way), wasted
(evicted, dropped or aged out before any request used it).

Where each block a request needs came from is counted in pdserve_decode_blocks_total{source}
(decode workers) or pdserve_prefill_blocks_total{source} (prefill workers: the prefix blocks a
Prefill reuses): resident (in the paged cache already, not brought by a prefetch), session / hot
(put in the paged cache by that prefetch signal), dispatch (staged by the dispatch hint), late
(a prefetch was still on its way), fetched (fetched on demand), missing (the kvstore lacked it,
or was unreachable: recomputed). The hit rate "blocks already here when the request arrived" is
(resident + session + hot + dispatch) over all of them.

Picking up prefill's blocks as they are written (before Prefill returns) is not done: prefill
puts the prompt's blocks in one stream after its last chunk, so there is nothing to pick up
early; Decode fetches them in one GetBlocks right after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import grpc
import torch
from prometheus_client import Counter

from kvstore.client import KVStoreProtocolError
from pdserve.kvwire import KVBlockError, decode_block
from pdserve.runtime.pins import hold_owner
from pdserve.v1 import worker_pb2
from pdserve.metric_registries import WORKER
from pdserve.worker_common import Worker, record_transfer
from pdserve.worker_metrics import KV_BLOCKS_REJECTED, PREFETCH_BLOCKS

log = logging.getLogger(__name__)

SIGNALS = ("dispatch", "session", "hot")
STAGED_TTL_S = 60.0  # a staged block no Decode claimed by then is dropped (wasted)
SOURCES = ("resident", *SIGNALS, "late", "fetched", "missing")
DECODE_BLOCKS = Counter("pdserve_decode_blocks_total",
                        "KV blocks Decode requests needed, by where each one was when the Decode arrived",
                        ["source"], registry=WORKER)
PREFILL_BLOCKS = Counter("pdserve_prefill_blocks_total",
                         "Prefix KV blocks Prefill requests reused, by where each one was when the Prefill arrived",
                         ["source"], registry=WORKER)


class BlockPrefetcher:
    def __init__(self, worker: Worker, max_staged_blocks: int = 4096,
                 clock: Callable[[], float] = time.monotonic, blocks_counter: Counter = DECODE_BLOCKS,
                 signals: Sequence[str] = SIGNALS, hold_s: float | None = None) -> None:
        self.worker = worker
        self.blocks_counter = blocks_counter  # where each needed block came from (DECODE_/PREFILL_BLOCKS)
        self.signals = tuple(signals)  # the signals this worker accepts
        self.max_staged_blocks = max_staged_blocks
        self._clock = clock
        # dispatch: decoded blocks waiting for their Decode, with when they were staged
        self._staged: OrderedDict[bytes, tuple[torch.Tensor, float]] = OrderedDict()
        self._inflight: dict[bytes, tuple[str, asyncio.Future]] = {}  # hash -> (signal, fetch task)
        self._promoted: dict[bytes, str] = {}  # session/hot blocks put in the paged cache, not used yet
        # hold_s: promoted chains are held by the engine (pdserve.runtime.pins) until a request is
        # admitted on them, this long has passed, or a running prompt needs the room, so that other
        # requests' steps cannot evict a prefetch before its turn comes.
        self.hold_s = hold_s
        self.hits = 0  # blocks a Decode found prefetched (any signal)
        self.rejected = 0  # blocks that failed their wire checks
        self.sources = dict.fromkeys(SOURCES, 0)  # what blocks_counter counts, also kept here

    def is_local(self, h: bytes) -> bool:
        return self.worker.aengine.is_resident(h)  # a hint: the engine re-checks at admission

    def prefetch(self, hashes: Sequence[bytes], signal: str = "dispatch") -> tuple[int, int]:
        """Starts fetching what is neither local, staged nor in flight; returns (local, fetching)."""
        if signal not in self.signals:
            raise ValueError(f"prefetch signal {signal!r} is not one this worker takes: use one of"
                             f" {', '.join(self.signals)}")
        self._drop_stale()
        wanted = [h for h in hashes if not self.is_local(h) and h not in self._staged and h not in self._inflight]
        holding = self.hold_s is not None and signal != "dispatch"  # the resident part is held too
        if wanted or holding:
            task = asyncio.ensure_future(self._fetch_and_place(wanted, signal, list(hashes)))
            for h in wanted:
                self._inflight[h] = (signal, task)
        return len(hashes) - len(wanted), len(wanted)

    async def gather(self, request_id: str, hashes: Sequence[bytes]) -> dict[bytes, torch.Tensor]:
        """The decoded blocks among `hashes` that are not in the paged cache already."""
        source: dict[bytes, str] = {}
        for h in hashes:
            signal = self._claim_promoted(h)
            if self.is_local(h):
                source[h] = signal or "resident"
        needed = [h for h in hashes if h not in source]
        found: dict[bytes, torch.Tensor] = {}
        for h in needed:
            if h in self._inflight:
                signal, task = self._inflight[h]
                PREFETCH_BLOCKS.labels(signal=signal, outcome="late").inc()
                source[h] = "late"
                await asyncio.shield(task)
                self._claim_promoted(h)
            if h in self._staged:
                found[h] = self._staged.pop(h)[0]
                self.hits += 1
                source.setdefault(h, "dispatch")
                PREFETCH_BLOCKS.labels(signal="dispatch", outcome="hit").inc()
        missing = [h for h in needed if h not in found and not self.is_local(h)]
        if missing:
            fetched = await self._fetch_or_none(missing, request_id)
            found.update(fetched)
            for h in missing:
                source.setdefault(h, "fetched" if h in fetched else "missing")
        for h in hashes:
            self._count(source.get(h, "late"))
        return found

    def _count(self, source: str) -> None:
        self.sources[source] += 1
        self.blocks_counter.labels(source=source).inc()

    def evicted(self, hashes: Iterable[bytes]) -> None:
        """Blocks that left the paged cache: promoted ones nobody used were wasted."""
        for h in hashes:
            signal = self._promoted.pop(h, None)
            if signal is not None:
                PREFETCH_BLOCKS.labels(signal=signal, outcome="wasted").inc()

    def sweep_evicted(self) -> None:
        """For a worker that reports no residency (prefill): promoted blocks that left the paged
        cache unused were wasted."""
        self.evicted([h for h in self._promoted if not self.is_local(h)])

    def _claim_promoted(self, h: bytes) -> str | None:
        """The signal that put `h` in the paged cache, if it is still there (counted as a hit)."""
        signal = self._promoted.pop(h, None)
        if signal is not None and self.is_local(h):
            self.hits += 1
            PREFETCH_BLOCKS.labels(signal=signal, outcome="hit").inc()
            return signal
        return None

    async def _fetch_and_place(self, hashes: list[bytes], signal: str, chain: list[bytes]) -> None:
        try:
            blocks = await self._fetch(hashes, request_id="") if hashes else {}
            if signal == "dispatch":
                self._stage(blocks)
            else:
                await self._promote(hashes, blocks, signal, chain)
        except Exception as exc:  # noqa: BLE001 - a hint must never fail a request
            log.warning("%s prefetch of %d blocks failed: %s", signal, len(hashes), exc)
        finally:
            for h in hashes:
                self._inflight.pop(h, None)

    def _stage(self, blocks: dict[bytes, torch.Tensor]) -> None:
        now = self._clock()
        for h, t in blocks.items():
            self._staged[h] = (t, now)
        while len(self._staged) > self.max_staged_blocks:
            self._staged.popitem(last=False)
            PREFETCH_BLOCKS.labels(signal="dispatch", outcome="wasted").inc()

    async def _promote(self, hashes: list[bytes], blocks: dict[bytes, torch.Tensor], signal: str,
                       chain_hashes: list[bytes]) -> None:
        """Puts the fetched `hashes` into the paged cache; with hold_s, the engine holds all of
        `chain_hashes` (what was resident already is as evictable)."""
        chain = [h for h in hashes if h in blocks]
        hold = hold_owner(signal) if self.hold_s is not None else None
        placed = await self.worker.aengine.place(chain, blocks, hold, chain_hashes, self.hold_s)
        for h in placed:
            self._promoted[h] = signal
        if len(chain) > len(placed):  # no room in the paged cache: fetched for nothing
            PREFETCH_BLOCKS.labels(signal=signal, outcome="wasted").inc(len(chain) - len(placed))

    def _drop_stale(self) -> None:
        cutoff = self._clock() - STAGED_TTL_S
        while self._staged and next(iter(self._staged.values()))[1] < cutoff:
            self._staged.popitem(last=False)
            PREFETCH_BLOCKS.labels(signal="dispatch", outcome="wasted").inc()

    async def _fetch_or_none(self, hashes: list[bytes], request_id: str) -> dict[bytes, torch.Tensor]:
        """The blocks fetched now; none when the kvstore fails (the engine computes them)."""
        try:
            blocks = await self._fetch(hashes, request_id)
        except (grpc.aio.AioRpcError, KVStoreProtocolError) as exc:
            self.worker.kv_outage.failed(f"fetch of {len(hashes)} blocks", exc)
            return {}
        self.worker.kv_outage.ok()
        return blocks

    async def _fetch(self, hashes: list[bytes], request_id: str) -> dict[bytes, torch.Tensor]:
        start = time.perf_counter()
        datas = await self.worker.kv.get_blocks(hashes, request_id)
        nbytes = sum(len(d) for d in datas if d)
        self.worker.counters.kv_bytes_received += nbytes
        record_transfer(self.worker, "get", nbytes, time.perf_counter() - start)
        return await asyncio.to_thread(self._decode_all, hashes, datas)

    def _decode_all(self, hashes: list[bytes], datas: list[bytes | None]) -> dict[bytes, torch.Tensor]:
        out, refused = {}, []
        fmt, key = self.worker.kv_format, self.worker.mac_key
        for h, data in zip(hashes, datas):
            if data is None:
                continue
            try:
                out[h], _ = decode_block(data, fmt, h, key)
            except KVBlockError as exc:
                refused.append((h, exc))
                KV_BLOCKS_REJECTED.labels(reason=exc.reason).inc()
        if refused:
            self.rejected += len(refused)
            self._log_refused(refused)
        return out

    @staticmethod
    def _log_refused(refused: list[tuple[bytes, KVBlockError]]) -> None:
        # One line per fetch, not per block: a poisoned prefix would otherwise flood the log.
        reasons = sorted({exc.reason for _, exc in refused})
        h, exc = refused[0]
        log.warning("%d KV block(s) rejected (%s), first %s: %s; the request will recompute them",
                    len(refused), ", ".join(reasons), h.hex()[:12], exc)


async def answer_prepare(prefetcher: BlockPrefetcher, request: worker_pb2.PrepareRequest,
                         context: grpc.aio.ServicerContext, default_signal: str) -> worker_pb2.PrepareResponse:
    """The Prepare rpc of either worker kind: start the prefetch, say what is local already."""
    try:
        local, fetching = prefetcher.prefetch(list(request.block_hashes), request.signal or default_signal)
    except ValueError as err:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
    return worker_pb2.PrepareResponse(blocks_local=local, blocks_fetching=fetching)
