"""The sharded model every rank runs, and rank 0's driver that keeps LlamaModel's interface.

`TensorParallelModel` is a LlamaModel built from one rank's shard (its heads, its MLP slice, its
vocabulary rows) with the group's all-reduce after o and down; it overrides the two places where
the vocabulary is split: the embedding (each rank looks up its rows, zeros elsewhere, one
all-reduce) and the logits (each rank its columns, gathered to rank 0). Any rank runs it.

`DriverModel` is what rank 0's ModelRunner holds in place of a LlamaModel: `forward` sends the
step's inputs to the other ranks, then runs the shard; `compute_logits` sends the rows to score,
then gathers the logits. Both under the channel's lock, so the collectives of one command are
never interleaved with another's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.runtime.attention import AttentionMetadata
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.parallel.group import TPGroup
from pdserve.runtime.parallel.kv_shard import ShardedKVCache
from pdserve.runtime.parallel.protocol import Channel, Op, pack_step, send_bytes
from pdserve.runtime.parallel.sharding import ShardLayout, shard_config, shard_layout, shard_weights


class TensorParallelModel(LlamaModel):
    """One rank's slice of the model; `full_config` is the whole model's shape."""

    def __init__(self, config: ModelConfig, weights: dict, group: TPGroup, device: str | torch.device) -> None:
        self.full_config = config
        self.group = group
        self.layout: ShardLayout = shard_layout(config, group.rank, group.size)
        super().__init__(shard_config(config, self.layout), shard_weights(config, weights, self.layout),
                         str(device), all_reduce=group.all_reduce)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, D]: this rank's vocabulary rows, summed over the ranks."""
        v0, _ = self.layout.vocab
        local = input_ids - v0
        mine = (local >= 0) & (local < self.layout.vocab_shard)
        hidden = F.embedding(local.clamp(0, self.layout.vocab_shard - 1), self.embed)  # [N, D]
        hidden = hidden * mine.unsqueeze(-1).to(hidden.dtype)
        return self.group.all_reduce(hidden)

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] -> this rank's logits columns [S, V / ranks] in fp32."""
        return F.linear(hidden, self.lm_head).float()

    def gather_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [S, D] (the same on every rank) -> logits [S, V] on rank 0, None elsewhere."""
        parts = self.group.gather(self.shard_logits(hidden).contiguous())
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.layout.vocab_size]


class DriverModel:
    """Rank 0's model: LlamaModel's interface over the whole group (ModelRunner needs no change)."""

    def __init__(self, model: TensorParallelModel, channel: Channel) -> None:
        self.model, self.channel = model, channel
        self.config = model.full_config
        self.kernels = model.kernels

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: ShardedKVCache, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The step on every rank; returns rank 0's final hidden states [N, D] (the same everywhere), or of
        `output_rows` [R] (LlamaModel.forward's: every rank computes every row, as its partial sums of
        the last layer meet the others')."""
        payload = pack_step(input_ids, positions, meta).to(self.model.group.device)
        with self.channel.lock:
            self.channel.send(Op.STEP, payload.numel())
            self.model.group.broadcast(payload)
            hidden = self.model.forward(input_ids, positions, meta, kv_cache.local)
        return hidden if output_rows is None else hidden[output_rows]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, D] -> logits [S, V] in fp32, the vocabulary's columns gathered from every rank."""
        if hidden.shape[0] == 0:
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=hidden.device)
        hidden = hidden.contiguous()
        with self.channel.lock:
            self.channel.send(Op.LOGITS, hidden.shape[0])
            send_bytes(self.model.group, hidden)
            logits = self.model.gather_logits(hidden)
        assert logits is not None  # rank 0
        return logits
