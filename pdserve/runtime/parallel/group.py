"""The tensor-parallel process group: rendezvous through a file, collectives with a timeout.

Ranks of one worker live on one machine, so they meet through a `FileStore` in a directory rank
0 creates (no port to pick and race for). Every collective has `collective_timeout_s`: a rank
that dies or hangs makes the others' next collective fail instead of waiting forever (a dead
peer's closed socket usually fails it at once; the timeout covers a peer that hangs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.runtime.config import ConfigError


JOIN_TIMEOUT_S = 600.0  # the ranks' wait for each other at start (each loads the checkpoint first)


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How a worker's model is split: `tensor_parallel_size` ranks per stage, `pipeline_parallel_size`
    stages of contiguous layers, each collective bounded. `micro_batches`: how many pieces a decode
    step's batch is cut into to flow through the stages (0: one per stage), none smaller than
    `micro_batch_rows` sequences (a decode micro-batch has a large fixed cost, its stage's weights
    read once more: on a CPU cutting a batch pays only from about 2 x 32 rows; docs/parallelism.md)."""

    tensor_parallel_size: int = 1
    collective_timeout_s: float = 30.0
    pipeline_parallel_size: int = 1
    micro_batches: int = 0
    micro_batch_rows: int = 32

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"--pipeline-parallel-size must be at least 1, got {self.pipeline_parallel_size}")
        if self.micro_batches < 0 or self.micro_batch_rows < 1:
            raise ConfigError(f"micro-batches must be 0 (one per stage) or more, of at least 1 row, got "
                              f"{self.micro_batches} of {self.micro_batch_rows}")
        if not self.collective_timeout_s > 0:  # also refuses NaN
            raise ConfigError(f"--collective-timeout-s must be > 0 seconds, got {self.collective_timeout_s:g}")

    @property
    def world_size(self) -> int:
        """Ranks (processes) of the worker, rank 0 included."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class CollectiveStats:
    """Time spent in the model's all-reduces (the cost tensor parallelism adds), for measurement."""

    all_reduces: int = 0
    all_reduce_s: float = 0.0


class TPGroup:
    """This process's rank in its worker's tensor-parallel group.

    A process group object of its own, not torch.distributed's default one: a process may hold
    several (tests and benchmarks run engines of several degrees side by side), and nothing else
    in the process is affected by it. Collectives go through its methods; `wait()` raises when a
    peer is gone or the timeout passes."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int, device: torch.device,
                 timeout_s: float = 30.0) -> None:
        self.pg, self.rank, self.size, self.device = pg, rank, size, device
        self.timeout = timedelta(seconds=timeout_s)  # bounds a point-to-point wait (pipeline stages)
        self.stage_group: TPGroup | None = None  # TP x PP: this rank's stage (its tensor-parallel group)
        self.timed = False  # measure all-reduce time (synchronizes a GPU per call)
        self.stats = CollectiveStats()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x [N, D] over the ranks, in place; returns it (the row-parallel projections' hook)."""
        if not self.timed:
            self.pg.allreduce([x]).wait()
            return x
        start = time.perf_counter()
        self.pg.allreduce([x]).wait()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.stats.all_reduces += 1
        self.stats.all_reduce_s += time.perf_counter() - start
        return x

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """t from rank 0 into every rank's t (same shape and dtype everywhere)."""
        self.pg.broadcast([t], dist.BroadcastOptions()).wait()  # root rank 0 by default
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's t (same shape) on rank 0, in rank order; None on the others."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        if self.device.type == "cuda":  # NCCL has no gather: all-gather, the others drop it
            self.pg.allgather([out], [t]).wait()
            return out if self.is_driver else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather([out] if self.is_driver else [], [t], opts).wait()
        return out if self.is_driver else None

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        """Starts sending t to rank `dst`; keep t alive until the returned work's `wait(self.timeout)`."""
        return self.pg.send([t], dst, tag)

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.pg.send([t], dst, tag).wait(self.timeout)

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Rank `src`'s matching send into t (shape and dtype agreed beforehand); returns t."""
        self.pg.recv([t], src, tag).wait(self.timeout)
        return t

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except (AttributeError, RuntimeError):  # older torch, or a group already broken
            pass


def init_group(rendezvous_dir: str, rank: int, size: int, device: str, timeout_s: float,
               check: Callable[[], None] | None = None, stage_size: int = 0) -> TPGroup:
    """Joins the group of `size` ranks meeting in `rendezvous_dir`; returns when all have joined.
    gloo on a CPU, NCCL on a GPU (each rank its own device); `timeout_s` bounds every collective.
    `check` (rank 0: are the other ranks still alive?) runs every second of the wait and may raise.
    With 1 < `stage_size` < `size` (tensor parallelism inside pipeline stages), the group's
    `stage_group` is this rank's stage: ranks [s * stage_size, (s + 1) * stage_size)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", (dev.index or 0) + rank)
        torch.cuda.set_device(dev)
    store = dist.FileStore(os.path.join(rendezvous_dir, "store"), size)
    # Ranks load the checkpoint before they come, at their own pace: wait for all of them here,
    # for as long as loading may take, so that the group itself starts with the short timeout.
    store.set(f"ready/{rank}", "1")
    _await_ranks(store, size, check)
    group = TPGroup(_process_group(store, rank, size, dev, timeout_s), rank, size, dev, timeout_s)
    if 1 < stage_size < size:
        s, t = divmod(rank, stage_size)
        sub = _process_group(dist.PrefixStore(f"stage{s}/", store), t, stage_size, dev, timeout_s)
        group.stage_group = TPGroup(sub, t, stage_size, dev, timeout_s)
        group.stage_group.all_reduce(torch.zeros(1, device=dev))
    # Last, after every stage group: when rank 0 returns from this, every rank is connected and
    # the store is done with.
    group.all_reduce(torch.zeros(1, device=dev))
    return group


def _process_group(store: dist.Store, rank: int, size: int, dev: torch.device, timeout_s: float) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    if dev.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Loopback: the ranks share the machine, and gloo's default device (the address the
    # hostname resolves to) may not be reachable in a container.
    opts._devices = [dist.ProcessGroupGloo.create_device(interface=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _await_ranks(store: dist.Store, size: int, check: Callable[[], None] | None) -> None:
    keys = [f"ready/{r}" for r in range(size)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            store.wait(keys, timedelta(seconds=1))
            return
        except (RuntimeError, dist.DistStoreError):  # not all there yet
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the tensor-parallel ranks did not all start within "
                                   f"{JOIN_TIMEOUT_S:.0f} s") from None
