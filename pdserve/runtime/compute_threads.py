"""In a worker process, one thread runs torch's parallel CPU ops: the engine thread.

Why. torch's CPU ops run on OpenMP (libgomp in the CPU wheels). libgomp gives every thread that
starts a parallel region a team of its own, and once the process holds more OpenMP threads than it
has cores, it cuts the time an idle team member spins before it sleeps from 300,000 iterations to
100. A decode step is about 2,000 small parallel regions (30 layers x some 70 ops), and each then
pays a futex wake-up. A worker loaded its model on the main thread (one team), stepped the engine
on the engine thread (a second) and decoded KV blocks in `asyncio.to_thread` workers (more): one
SmolLM2 decode step took 24 ms there against 11 ms on a benchmark's main thread (bf16, int4,
batch 1, 2 cores).

So a worker sets torch's process-wide thread count to 1 before it runs any op, which gives every
thread a team of one (no OpenMP threads beside it), and raises only the engine thread's own count
(OpenMP's per-thread `nthreads` setting, through threadpoolctl) to the configured number. The
model loads on a short-lived thread that claims the same count; libgomp frees a thread's team when
the thread exits.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from threadpoolctl import ThreadpoolController, threadpool_limits

T = TypeVar("T")


def default_threads() -> int:
    """The cores this process may run on (torch's own default count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def one_thread_by_default(threads: int) -> int:
    """Sets the process-wide torch count to 1 and returns the count the engine thread should claim:
    `threads`, or all cores for 0.

    The process-wide count is also MKL's, which an op on one OpenMP thread calls outside a parallel
    region (inside one MKL runs on one thread): at 1, a GEMM inside an op has the same bits whether the
    engine thread holds one thread or more, so switching the claim (runtime.core_share) changes no bit.
    At 2 it did not: torch's fp32 flash attention of a prompt chunk after a prefix differed."""
    claimed = threads or default_threads()
    torch.set_num_threads(1)
    return claimed


@contextmanager
def one_thread() -> Iterator[None]:
    """The calling thread's torch ops on one OpenMP thread inside the block, its count restored after
    (5 us): for a run of ops too small to split, each of which would otherwise wait at its end for
    the team's other threads, a time slice each when another process has their core."""
    with _openmp().limit(limits=1):
        yield


@functools.cache
def _openmp() -> ThreadpoolController:
    return ThreadpoolController().select(user_api="openmp")  # the libraries scanned once


def claim(threads: int) -> None:
    """Gives the calling thread `threads` OpenMP threads for its torch ops, other threads unchanged."""
    # torch sets a thread's OpenMP count from the process-wide one at the thread's first op (a
    # thread-local lazy init); run it first, or it would undo the raise below.
    torch.get_num_threads()
    threadpool_limits(threads, user_api="openmp")


def run_claimed(threads: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args) on a new thread that claims `threads`, joined; its result, or its exception raised here."""
    box: dict[str, object] = {}

    def body() -> None:
        claim(threads)
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = exc

    worker = threading.Thread(target=body, name="engine-load")
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]


def thread_setter() -> Callable[[int], None]:
    """A function that sets the calling thread's OpenMP thread count, quickly: the OpenMP libraries
    are found once, here (`claim` finds them on every call, about 0.2 ms)."""
    from threadpoolctl import ThreadpoolController

    libraries = ThreadpoolController().select(user_api="openmp").lib_controllers

    def set_threads(threads: int) -> None:
        for library in libraries:
            library.set_num_threads(threads)
    return set_threads
