"""ModelRunner: turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import torch

from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.cuda_graph import CudaGraphDecodeRunner, DecodeBatch
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.scheduler import ScheduledSeq, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, layers, 2, block_size, KVH, D]
        self.block_size = block_size
        self.device = device
        self.graphs: CudaGraphDecodeRunner | None = None  # set by enable_cuda_graphs

    def enable_cuda_graphs(self, max_batch: int, max_blocks_per_seq: int) -> bool:
        """Capture decode steps up to `max_batch` sequences (see cuda_graph); False, and steps
        stay eager, when the device or the kernels cannot replay graphs."""
        from pdserve.runtime.kernels import torch_ops

        if not str(self.device).startswith("cuda") or self.model.kernels is torch_ops:
            return False
        runner = CudaGraphDecodeRunner(self.model, self.kv_cache, max_batch, max_blocks_per_seq)
        runner.capture()
        self.graphs = runner
        return True

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Runs one step; returns logits [R, V]: a row for each scheduled sequence that samples, in
        order, 1 + len(draft) rows for a speculative one (after its last token and each draft token)."""
        if self.graphs is not None and out.decodes and not out.prefills and self.graphs.fits(len(out.decodes)):
            return self.graphs.run(self._decode_batch(out.decodes))  # every decode row samples
        input_ids, positions, meta, sample_rows = self._prepare(out)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, output_rows=sample_rows)  # [R, D]
        return self.model.compute_logits(hidden)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        generated: list[bool] = []
        for s in out.decodes + out.prefills:
            start = s.seq.num_computed_tokens
            first_generated = len(s.seq.prompt_ids) - s.seq.resumed_tokens  # a resumed stream's tail is ours
            generated.extend(p >= first_generated for p in range(start, start + s.num_new_tokens))
            ids.extend(s.seq.token_ids[start:start + s.num_new_tokens - len(s.draft)])
            ids.extend(s.draft)
            pos.extend(range(start, start + s.num_new_tokens))
            slots.extend(self._slots(s, start))
            if s.samples:  # a speculative chunk samples at its last token and after each draft token
                sample_rows.extend(range(len(ids) - 1 - len(s.draft), len(ids)))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(out.decodes),
            decode_block_tables=self._block_tables(out.decodes),
            decode_context_lens=self._tensor([s.seq.num_computed_tokens + 1 for s in out.decodes]),
            prefills=self._prefill_spans(out),
            generated_rows=torch.tensor(generated, dtype=torch.bool),
        )
        return self._tensor(ids), self._tensor(pos), meta, self._tensor(sample_rows)

    def _decode_batch(self, decodes: list[ScheduledSeq]) -> DecodeBatch:
        """The step's decode rows on the host, for the graph runner's static buffers."""
        starts = [s.seq.num_computed_tokens for s in decodes]
        return DecodeBatch(
            token_ids=[s.seq.token_ids[p] for s, p in zip(decodes, starts)],
            positions=starts,
            slots=[self._slots(s, p)[0] for s, p in zip(decodes, starts)],
            block_tables=[list(s.seq.block_table) for s in decodes],
            context_lens=[p + 1 for p in starts])

    def _slots(self, s: ScheduledSeq, start: int) -> list[int]:
        bs, table = self.block_size, s.seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + s.num_new_tokens)]

    def _block_tables(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        width = max((len(s.seq.block_table) for s in decodes), default=0)
        rows = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
        return torch.tensor(rows, dtype=torch.long, device=self.device).view(len(decodes), width)

    def _prefill_spans(self, out: SchedulerOutput) -> tuple[PrefillSpan, ...]:
        spans, start = [], len(out.decodes)
        for s in out.prefills:
            spans.append(PrefillSpan(start, s.num_new_tokens, s.seq.num_computed_tokens + s.num_new_tokens,
                                     self._tensor(s.seq.block_table)))
            start += s.num_new_tokens
        return tuple(spans)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
