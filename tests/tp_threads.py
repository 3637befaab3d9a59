"""Tensor parallelism with every rank a thread of the test process: the production driver, channel,
follower loop, sharded model and cache over an in-process group (`ThreadGroup`), so that the
sharding of many configs is checked without starting a process per rank (tests/test_tensor_parallel.py
starts real gloo ranks for the rest)."""

from __future__ import annotations

import threading

import torch

from pdserve.quant.int4_codes import weights_for
from pdserve.runtime.engine import Engine
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.parallel import follower
from pdserve.runtime.parallel.group import CollectiveStats, ParallelConfig
from pdserve.runtime.parallel.launch import attach
from pdserve.runtime.parallel.tp_model import TensorParallelModel

BARRIER_S = 30.0  # a rank that never arrives fails the others' collective instead of hanging the test


class ThreadGroup:
    """TPGroup's interface over threads: a slot per rank and a barrier around each collective."""

    def __init__(self, rank: int, size: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.size, self.device = rank, size, torch.device("cpu")
        self.slots, self.barrier = slots, barrier
        self.timed, self.stats = False, CollectiveStats()

    @classmethod
    def make(cls, size: int) -> list[ThreadGroup]:
        slots: list = [None] * size
        barrier = threading.Barrier(size, timeout=BARRIER_S)
        return [cls(r, size, slots, barrier) for r in range(size)]

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = t.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return got

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        x.copy_(torch.stack(parts).sum(0))
        return x

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        t.copy_(self._exchange(t)[0])
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._exchange(t)
        return parts if self.is_driver else None

    def close(self) -> None:
        pass


def threaded_tp_engine(checkpoint, config, size: int) -> tuple[Engine, callable]:
    """(rank 0's Engine, close) with ranks 1..size-1 serving on threads."""
    weights, _ = weights_for(checkpoint, config)
    engine = Engine.from_checkpoint(checkpoint, config)
    groups = ThreadGroup.make(size)

    def rank(r: int) -> None:
        model = TensorParallelModel(checkpoint.config, weights, groups[r], "cpu")
        follower.serve(model, allocate_kv_cache(model.config, config.cache, "cpu"), groups[r])

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, size)]
    for t in threads:
        t.start()
    channel, _ = attach(engine, weights, groups[0], ParallelConfig(size, BARRIER_S))

    return engine, closer(channel, threads)


def closer(channel, threads: list[threading.Thread]):  # -> the close() of a threaded engine
    """Closes rank 0's channel (the other ranks' loops then end) and checks every rank thread ended."""
    def close() -> None:
        channel.close()
        for t in threads:
            t.join(timeout=BARRIER_S)
        assert not any(t.is_alive() for t in threads)
    return close
