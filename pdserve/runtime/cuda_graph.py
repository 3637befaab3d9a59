"""CUDA graphs for decode-only steps: one launch per step instead of hundreds.

A decode step of a small model on a GPU is bound by launch overhead (every layer is a handful
of tiny kernels), so the runner captures the model's forward + logits once per batch size in
`capture_sizes` and replays the graph for every decode-only step whose batch fits, padding the
batch up to the next captured size. Steps with prefill tokens, and batches above the largest
size, run eagerly.

What makes replay valid: a graph bakes in every pointer and launch shape, so
  * inputs live in `StaticDecodeBuffers`, allocated once and filled in place each step;
  * block tables are padded to the widest table the cache allows (`max_blocks_per_seq`), so
    the decode kernel's split-K grid (sized from the table width, never from a host-read
    length) is the same at capture and at replay;
  * padding rows write no KV (slot -1, skipped by the CUDA write kernel) and attend to nothing
    (context length 0 gives zeros); their logits are dropped.
The CUDA kernels (`kernels.cuda_ops`) were written for this: no host syncs, launches on torch's
current stream. The torch fallback kernels are not (a negative slot would index from the end),
so graphs are only used with the CUDA kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.runtime.attention import AttentionMetadata
from pdserve.runtime.model import LlamaModel

log = logging.getLogger(__name__)

BASE_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PAD_SLOT = -1  # write_kv skips negative slots


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes to capture: the base sizes up to `max_batch`, and `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [s for s in BASE_CAPTURE_SIZES if s < max_batch]
    return (*sizes, max_batch)


def padded_size(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch` sequences; None when none does."""
    return next((s for s in sizes if s >= batch), None)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode step on the host: a row per sequence, one new token each."""

    token_ids: list[int]  # the token whose KV the step writes and whose logits it returns
    positions: list[int]
    slots: list[int]  # block_id * block_size + offset of that token
    block_tables: list[list[int]]  # each sequence's blocks, unpadded
    context_lens: list[int]  # tokens attended to, the new one included

    def __len__(self) -> int:
        return len(self.token_ids)


class StaticDecodeBuffers:
    """The inputs of every captured graph, allocated once; `fill` writes a step into them."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        long = dict(dtype=torch.long, device=device)
        self.token_ids = torch.zeros(max_batch, **long)  # [Bmax]
        self.positions = torch.zeros(max_batch, **long)  # [Bmax]
        self.slots = torch.full((max_batch,), PAD_SLOT, **long)  # [Bmax]
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, **long)  # [Bmax, MB]
        self.context_lens = torch.zeros(max_batch, **long)  # [Bmax]

    def fill(self, batch: DecodeBatch, padded: int) -> None:
        """Rows [0, len(batch)) get the step; rows up to `padded` become inert padding."""
        n = len(batch)
        if not n <= padded <= self.max_batch:
            raise ValueError(f"batch {n} padded to {padded} does not fit {self.max_batch} rows")
        if any(len(t) > self.max_blocks_per_seq for t in batch.block_tables):
            raise ValueError(f"a block table is wider than max_blocks_per_seq={self.max_blocks_per_seq}")
        pad = padded - n
        # One host->device copy per tensor: build padded host rows first.
        self._copy(self.token_ids, batch.token_ids + [0] * pad)
        self._copy(self.positions, batch.positions + [0] * pad)
        self._copy(self.slots, batch.slots + [PAD_SLOT] * pad)
        self._copy(self.context_lens, batch.context_lens + [0] * pad)
        width = self.max_blocks_per_seq
        rows = [t + [0] * (width - len(t)) for t in batch.block_tables] + [[0] * width] * pad
        self._copy(self.block_tables[:padded], rows)

    def metadata(self, padded: int) -> AttentionMetadata:
        """Attention metadata over the first `padded` rows (views: valid for every replay)."""
        return AttentionMetadata(slot_mapping=self.slots[:padded], num_decode_tokens=padded,
                                 decode_block_tables=self.block_tables[:padded],
                                 decode_context_lens=self.context_lens[:padded], prefills=())

    @staticmethod
    def _copy(dst: torch.Tensor, rows: list) -> None:
        src = torch.tensor(rows, dtype=dst.dtype)
        dst[: src.shape[0]].copy_(src, non_blocking=True)


class CudaGraphDecodeRunner:
    """Captures decode steps per batch size and replays them."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_batch: int,
                 max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, layers, 2, block_size, KVH, D]
        self.sizes = capture_sizes(max_batch)
        self.buffers = StaticDecodeBuffers(max_batch, max_blocks_per_seq, kv_cache.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # padded size -> its graph's output [P, V]
        self._pool = None

    def capture(self) -> None:
        """Capture every size, largest first so that smaller graphs reuse its memory pool."""
        for size in reversed(self.sizes):
            self._capture_one(size)
        torch.cuda.synchronize(self.kv_cache.device)
        log.info("captured decode CUDA graphs for batch sizes %s", ",".join(map(str, self.sizes)))

    def fits(self, batch_size: int) -> bool:
        return padded_size(batch_size, self.sizes) is not None

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits [B, V] of the step (a fresh tensor: the next replay overwrites the graph's)."""
        padded = padded_size(len(batch), self.sizes)
        if padded is None:
            raise ValueError(f"batch {len(batch)} exceeds the largest captured size {self.sizes[-1]}")
        self.buffers.fill(batch, padded)
        self.graphs[padded].replay()
        return self.logits[padded][: len(batch)].clone()

    def _forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        hidden = self.model.forward(b.token_ids[:size], b.positions[:size], b.metadata(size), self.kv_cache)
        return self.model.compute_logits(hidden)  # [size, V]

    def _capture_one(self, size: int) -> None:
        self.buffers.fill(DecodeBatch([], [], [], [], []), size)  # all padding: writes no KV
        side = torch.cuda.Stream(self.kv_cache.device)
        side.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(side):
            self._forward(size)  # warm-up: compiles kernels and lets allocators settle before capture
        torch.cuda.current_stream(self.kv_cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self.logits[size] = self._forward(size)
        self._pool = graph.pool()
        self.graphs[size] = graph
