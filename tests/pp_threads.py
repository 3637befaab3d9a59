"""Pipeline parallelism with every stage a thread of the test process: the production driver,
channel, stage loop, stage models and cache over an in-process group (tp_threads.ThreadGroup plus
point-to-point queues), so that configs and micro-batch counts are checked without starting a
process per stage (tests/test_pipeline_parallel.py starts real gloo stages for the rest)."""

from __future__ import annotations

import queue
import threading

import torch

from pdserve.runtime.engine import Engine
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.parallel.group import ParallelConfig
from pdserve.runtime.parallel.launch import attach
from pdserve.runtime.parallel.pp_model import StageModel, serve_stage
from pdserve.runtime.parallel.stages import pipeline_weights
from tp_threads import BARRIER_S, ThreadGroup, closer


class _Sent:
    def wait(self, timeout=None) -> bool:
        return True


class StageThreadGroup(ThreadGroup):
    """ThreadGroup with send/recv: one queue per (source, destination, tag)."""

    def __init__(self, rank: int, size: int, slots: list, barrier: threading.Barrier, mailboxes: dict,
                 lock: threading.Lock) -> None:
        super().__init__(rank, size, slots, barrier)
        self.mailboxes, self.lock, self.timeout = mailboxes, lock, BARRIER_S
        self.stage_group: ThreadGroup | None = None

    @classmethod
    def make(cls, size: int) -> list[StageThreadGroup]:
        slots: list = [None] * size
        barrier, mailboxes, lock = threading.Barrier(size, timeout=BARRIER_S), {}, threading.Lock()
        return [cls(r, size, slots, barrier, mailboxes, lock) for r in range(size)]

    def _box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.mailboxes.setdefault((src, dst, tag), queue.Queue())

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> _Sent:
        self._box(self.rank, dst, tag).put(t.clone())
        return _Sent()

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(t, dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        t.copy_(self._box(src, self.rank, tag).get(timeout=BARRIER_S))
        return t


def threaded_pp_engine(checkpoint, config, stages: int, micro_batches: int = 0, tp: int = 1) -> tuple[Engine, callable]:
    """(rank 0's Engine, close) with the other ranks serving on threads: `stages` stages of `tp`
    tensor-parallel ranks each (rank s * tp + t)."""
    weights = pipeline_weights(checkpoint, config, tp)  # as the real ranks load them
    engine = Engine.from_checkpoint(checkpoint, config)
    groups = StageThreadGroup.make(stages * tp)
    if tp > 1:
        for s in range(stages):
            for t, sub in enumerate(ThreadGroup.make(tp)):
                groups[s * tp + t].stage_group = sub

    def stage(r: int) -> None:
        model = StageModel(checkpoint.config, weights, groups[r], "cpu", tp_group=groups[r].stage_group, engine=config)
        serve_stage(model, allocate_kv_cache(model.config, config.cache, "cpu"), groups[r])

    threads = [threading.Thread(target=stage, args=(r,), daemon=True) for r in range(1, stages * tp)]
    for t in threads:
        t.start()
    parallel = ParallelConfig(tp, collective_timeout_s=BARRIER_S, pipeline_parallel_size=stages,
                              micro_batches=micro_batches, micro_batch_rows=1)
    channel, _ = attach(engine, weights, groups[0], parallel)

    return engine, closer(channel, threads)
