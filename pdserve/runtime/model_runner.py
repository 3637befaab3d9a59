"""ModelRunner: turns a SchedulerOutput into flat tensors, runs the model, returns logits."""

from __future__ import annotations

import torch

from pdserve.runtime.attention import AttentionMetadata, PrefillSpan
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.scheduler import ScheduledSeq, SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, device: str) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, layers, 2, block_size, KVH, D]
        self.block_size = block_size
        self.device = device

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Runs one step; returns logits [S, V] for the scheduled sequences that sample."""
        input_ids, positions, meta, sample_rows = self._prepare(out)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)  # [N, D]
        return self.model.compute_logits(hidden[sample_rows])

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for s in out.decodes + out.prefills:
            start = s.seq.num_computed_tokens
            ids.extend(s.seq.token_ids[start:start + s.num_new_tokens])
            pos.extend(range(start, start + s.num_new_tokens))
            slots.extend(self._slots(s, start))
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(out.decodes),
            decode_block_tables=self._block_tables(out.decodes),
            decode_context_lens=self._tensor([s.seq.num_computed_tokens + 1 for s in out.decodes]),
            prefills=self._prefill_spans(out),
        )
        return self._tensor(ids), self._tensor(pos), meta, self._tensor(sample_rows)

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
