"""2 MB pages for a CPU worker's loaded weights (Linux transparent huge pages, MADV_COLLAPSE).

Why: a decode step reads every weight once; on 4 KB pages each page is a TLB miss and a fresh start
for the hardware prefetchers, which stop at page boundaries. Most Linux hosts run THP in `madvise`
mode (only memory that asks gets 2 MB pages), and nothing in torch or glibc asks by default.
SmolLM2 bf16 decode steps on two threads of a 2-core Xeon (`benchmarks/decode_step.py --threads 2
--prompt-len 200 --huge-pages on|off`): 12.3-12.9 -> 8.1-8.6 ms at one sequence, where the step
is its weights' reading; at 32 sequences unchanged within the noise (40.5-42.8 against 41.7-43.6).
Through the stack (`pdserve up`, 32 streams, the same host in the same rounds), where the decode
worker's steps share the cores and caches with the prefill worker's: 242.4 / 227.0 tok/s against
191.8 / 173.0 with `--huge-pages off`.

`collapse_loaded` runs once the weights are loaded and packed: MADV_COLLAPSE (Linux 6.1+) copies
each 2 MB range into a huge page there and then. The weights are many tensors of a few hundred KB in
the allocator's heaps, so it collapses the process's anonymous read-write mappings as they stand,
but for the ones named (the KV cache: collapsing its untouched pages would make all of it resident).
The RSS grows by what the ranges held unwritten (SmolLM2's worker: 983 -> 989 MB). A range the
kernel will not collapse (EINVAL: a kernel before 6.1, or a mapping it finds ineligible) is asked
MADV_HUGEPAGE instead (khugepaged may collapse it later, slowly); where THP is off, nothing changes.
Contents never change: only how the kernel maps them.

It is not free: copying into fresh 2 MB pages took 4.1-10.6 s for SmolLM2's 786 MB on this host
(glibc's `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which has the allocator ask for huge pages as it
maps, costs the same 5 s at load), so a worker is ready that much later; a model of fewer than
MIN_PARAMETERS parameters (stories260K and the tests' random models) gains nothing measurable from it
and is left alone (a tiny-model stack started 1.4-1.9 s later with it).

Measured and not kept: the KV cache's mapping advised MADV_HUGEPAGE before it is written. Once
written, a 32-sequence attention over 30 layers ran 43 -> 35 ms (one thread); but each first write
into a 2 MB range then faults a huge page in (zeroed, compacted for, with THP's `madvise` defrag):
decode steps of 32 sequences whose blocks were being written took 45.0-51.4 ms against 41.7-43.6, and
the stack at 32 streams served 194.0 / 190.2 tok/s against 227.1 / 235.0. Faulting the whole cache in
at start instead (its RSS from the start, as vLLM's CPU backend allocates it): 264.1 / 234.4 against
247.3, within the noise, for 1.5 GB more resident from the start: not kept either.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.runtime.parallel.stages import stage_costs

HUGE_PAGE = 1 << 21
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Below this many parameters (about 32 MB of bf16 weights: the size of a server CPU's L3 share) the
# step's weights mostly come from cache, and the collapse's seconds buy nothing.
MIN_PARAMETERS = 16_000_000


@dataclass(frozen=True, slots=True)
class Collapsed:
    """What `collapse` did, in bytes: now on 2 MB pages; only advised MADV_HUGEPAGE (ranges the kernel
    would not collapse: EINVAL); not collapsed for want of free huge pages or a busy range (ENOMEM,
    EAGAIN: best effort, those stay on 4 KB pages)."""

    collapsed: int = 0
    advised: int = 0
    failed: int = 0
    errors: frozenset[int] = frozenset()  # the errnos of the failed ranges


def describe_errors(errors: Iterable[int]) -> str:
    """The errnos of failed ranges as a person reads them ("ENOMEM: Cannot allocate memory"), or "none"."""
    return ", ".join(f"{errno.errorcode.get(e, e)}: {os.strerror(e)}" for e in sorted(errors)) or "none"


def thp_mode() -> str | None:
    """The host's THP setting ("always", "madvise", "never"); None where there is none (not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else None


def available() -> bool:
    """Whether asking for huge pages can change anything here: Linux with THP not `never`."""
    return thp_mode() in ("always", "madvise") and _libc() is not None


def worth_it(model) -> bool:
    """Whether a model (a ModelConfig) is large enough for `collapse_loaded` to pay (MIN_PARAMETERS): its
    layers' projections and its head, the weights a step reads (a multiply-add each: stage_costs)."""
    layer, head = stage_costs(model)
    return model.num_layers * layer + head >= MIN_PARAMETERS


def collapse_loaded(exclude: Iterable[tuple[int, int]] = ()) -> Collapsed:
    """Collapses the process's anonymous read-write memory (the loaded weights) into 2 MB pages, but for
    the mappings overlapping the [start, end) ranges in `exclude`."""
    if not available():
        return Collapsed()
    return collapse(loaded_ranges(anonymous_mappings(), exclude))


def loaded_ranges(mappings: Iterable[tuple[int, int]],
                  exclude: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The whole 2 MB pages inside each [start, end) mapping that overlaps no range of `exclude`."""
    skip = list(exclude)
    ranges = []
    for start, end in mappings:
        lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if hi > lo and not any(s < end and start < e for s, e in skip):
            ranges.append((lo, hi))
    return ranges


def collapse(ranges: Iterable[tuple[int, int]]) -> Collapsed:
    """MADV_COLLAPSE on each [start, end) range (2 MB aligned); MADV_HUGEPAGE where the kernel will not."""
    libc = _libc()
    if libc is None:
        return Collapsed()
    collapsed = advised = failed = 0
    errors: set[int] = set()
    for lo, hi in ranges:
        if libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
        elif ctypes.get_errno() == errno.EINVAL and libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0:
            advised += hi - lo  # khugepaged's to do, if it will
        else:
            failed += hi - lo
            errors.add(ctypes.get_errno())
    return Collapsed(collapsed=collapsed, advised=advised, failed=failed, errors=frozenset(errors))


def span(tensor) -> tuple[int, int]:
    """[start, end) of a contiguous CPU tensor's bytes (an `exclude` range of `collapse_loaded`)."""
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def anonymous_mappings(maps: Path = Path("/proc/self/maps")) -> Iterator[tuple[int, int]]:
    """[start, end) of each private anonymous read-write mapping (the heap, the allocator's arenas and
    large blocks; not files, stacks or the vDSO)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p":
            continue
        name = fields[5].strip() if len(fields) > 5 else ""
        if name not in ("", "[heap]"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        yield start, end


def mapping_field(address: int, field: str, smaps: Path = Path("/proc/self/smaps")) -> int:
    """A field of /proc/self/smaps ("AnonHugePages", "Rss", ...) for the mapping holding `address`, in
    bytes; 0 where no mapping holds it or there is no such file (not Linux)."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field + ":":
            return int(line.split()[1]) * 1024
    return 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
