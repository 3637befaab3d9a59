"""PinTable: the references on cached blocks that no sequence holds, each with a named owner.

A pin keeps a block the paged cache holds from being evicted until something that will use it
arrives. Two kinds, by owner:
  * a request's own (`request_owner(id)`, no expiry): a Prefill pins the prefix blocks that are
    resident when it starts, so that other prompts' steps cannot evict them while it fetches the
    rest. The sequence of that id takes them over: they are dropped when the scheduler admits it
    (its block table references them by then), or when it is aborted; unpinning them while the
    sequence is still queued does nothing.
  * a hold (any other owner, with an expiry): a session or hot-prefix prefetch keeps its chain
    until a request is admitted on it (`claim`), its time is up (`expire`), or a prompt that
    runs now needs the room (`give_up`, soonest to expire first).
Pinning what an owner pins already refreshes its expiry; it never takes a second reference, so
two prefetches of one chain landing together hold each block once. Every method runs on the
engine thread; `block_ids` lets the leak check count pins beside the sequences' tables.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from pdserve.runtime.block_manager import BlockManager

Owner = tuple[str, str]  # (kind, name): ("request", id) or ("hold", signal)


def request_owner(request_id: str) -> Owner:
    return ("request", request_id)


def hold_owner(name: str) -> Owner:
    return ("hold", name)


@dataclass(slots=True)
class Pin:
    block_id: int
    expires_at: float | None  # None: until unpinned (a request's own)


class PinTable:
    def __init__(self, blocks: BlockManager, clock: Callable[[], float] = time.monotonic) -> None:
        self.blocks = blocks
        self.clock = clock
        self._pins: dict[Owner, dict[bytes, Pin]] = {}

    def pin(self, owner: Owner, hashes: Iterable[bytes], ttl_s: float | None = None) -> int:
        """References each of `hashes` the cache holds, for `owner`; returns how many `owner` holds
        among them now. `ttl_s`: a hold that ends by itself that many seconds from now."""
        expires_at = None if ttl_s is None else self.clock() + ttl_s
        pins = self._pins.setdefault(owner, {})
        held = 0
        for h in hashes:
            if h in pins:
                pins[h].expires_at = _later(pins[h].expires_at, expires_at)
            else:
                bid = self.blocks.ref_cached(h)
                if bid is None:
                    continue
                pins[h] = Pin(bid, expires_at)
            held += 1
        if not pins:
            del self._pins[owner]
        return held

    def unpin(self, owner: Owner, hashes: Collection[bytes] | None = None) -> int:
        """Drops `owner`'s pins on `hashes` (all of them by default); returns how many."""
        pins = self._pins.get(owner)
        if not pins:
            return 0
        gone = [h for h in pins if hashes is None or h in hashes]
        self.blocks.release([pins.pop(h).block_id for h in gone])
        if not pins:
            del self._pins[owner]
        return len(gone)

    def claim(self, hashes: Collection[bytes]) -> None:
        """A sequence now references these blocks: the holds on them have done their job."""
        owners = [o for o in self._pins if o[0] == "hold"]
        if owners:
            hashes = set(hashes)
            for owner in owners:
                self.unpin(owner, hashes)

    def expire(self) -> int:
        """Drops the holds whose time is up (their blocks stay cached, evictable); how many."""
        now = self.clock()
        return sum(self.unpin(owner, [h for h, p in pins.items() if p.expires_at is not None and p.expires_at <= now])
                   for owner, pins in list(self._pins.items()))

    def give_up(self, blocks: int) -> int:
        """Drops holds, the soonest to expire first, until `blocks` more blocks are free or none
        is left; returns the blocks freed. A prompt that runs now beats a turn still to come."""
        holds = sorted(((p.expires_at, owner, h) for owner, pins in self._pins.items() if owner[0] == "hold"
                        for h, p in pins.items()), key=lambda t: t[0])
        before = self.blocks.num_free_blocks
        for _, owner, h in holds:
            if self.blocks.num_free_blocks - before >= blocks:
                break
            self.unpin(owner, [h])
        return self.blocks.num_free_blocks - before

    def has_holds(self) -> bool:
        return any(owner[0] == "hold" for owner in self._pins)

    def holders(self, owner: Owner) -> set[bytes]:
        return set(self._pins.get(owner, ()))

    def block_ids(self) -> list[int]:
        """One entry per pin (a block pinned by two owners appears twice), for the leak check."""
        return [p.block_id for pins in self._pins.values() for p in pins.values()]

    def __len__(self) -> int:
        return sum(len(pins) for pins in self._pins.values())


def _later(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None  # a pin without expiry stays one
    return max(a, b)
