"""Pipeline parallelism: each rank a stage of contiguous layers; a step's hidden states flow
stage to stage, micro-batch by micro-batch, and the logits come back to rank 0.

Rank 0 broadcasts the step's inputs to every stage (header STEP, micro-batch count; the packed
step, as tensor parallelism does), then every stage runs `pipeline_step`: it cuts a decode step's
batch into the same k micro-batches (rows are contiguous, so every stage agrees on their sizes),
and for each receives the previous stage's (hidden, residual) [2, n, D], runs its layers, and
starts sending the result on (isend: stage s works on micro-batch j while stage s+1 works on
j-1). The last stage ends in the final norm; in a decode-only step every row samples, so it
computes each micro-batch's logits at once and sends them to rank 0 inside the pipeline. A step
with prefill chunks runs as one micro-batch and the last stage keeps its final hidden states until
`compute_logits` says which rows to score (op LOGITS with the row indices).

`PipelineDriver` is what rank 0's ModelRunner holds in place of a LlamaModel: its `forward`
returns row handles [N, 1] (row i holds i), not hidden states, because those live on the last
stage; ModelRunner only selects rows of what forward returns before `compute_logits`, which reads
the indices back. Each rank counts the time it computes (`StageStats`): the rest of a step is its
bubble.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.quant.int4_cpu import token_kinds_of
from pdserve.runtime.attention import AttentionMetadata
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.model import LlamaModel, PagedAttention
from pdserve.runtime.parallel.group import TPGroup
from pdserve.runtime.parallel.protocol import Channel, Op, pack_step, recv_header, unpack_step
from pdserve.runtime.parallel.stages import StageLayout, stage_config, stage_layout, stage_weights
from pdserve.runtime.parallel.tp_model import TensorParallelModel

LOGITS_TAG = 1 << 20  # p2p tags: micro-batch j's hidden states go as tag j, its logits as LOGITS_TAG + j


@dataclass(slots=True)
class StageStats:
    """Seconds this stage computed (its layers, and the head on the last stage) and spent inside
    pipeline steps (computing or waiting), over `steps` steps."""

    busy_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0


class StageModel:
    """One stage's layers, renumbered from 0: a LlamaModel of them, or with a `tp_group` this
    rank's tensor-parallel shard of them (TP x PP). `full_config` is the whole model's shape,
    `config` this rank's (what its KV cache is allocated for). `engine`: the engine's settings, so
    that a stage of one rank packs its layers as one process's engine does (dense copies, prompt
    rows' kernel: quant.linear.keep_dense_copy); its weights come from `stages.pipeline_weights`."""

    def __init__(self, config: ModelConfig, weights: dict, group: TPGroup, device: str | torch.device,
                 tp_group: TPGroup | None = None, engine: EngineConfig | None = None) -> None:
        self.full_config, self.group, self.tp_group = config, group, tp_group
        self.tp = tp_group.size if tp_group is not None else 1
        self.layout: StageLayout = stage_layout(config, group.rank // self.tp, group.size // self.tp)
        cfg, w = stage_config(config, self.layout), stage_weights(config, weights, self.layout)
        self.inner = (LlamaModel(cfg, w, str(device)) if tp_group is None
                      else TensorParallelModel(cfg, w, tp_group, device))
        if tp_group is None and engine is not None and engine.dense_copy:
            self.inner.keep_dense_copies(int8_prompts=engine.int8_prompts)
        self.config, self.kernels, self.dtype = self.inner.config, self.inner.kernels, self.inner.embed.dtype
        self.stats = StageStats()
        self.kept: torch.Tensor | None = None  # last stage: a prefill step's final hidden states [N, D]

    @property
    def is_stage_leader(self) -> bool:
        """The stage's rank that holds whole logits (its first: they are gathered to it)."""
        return self.tp_group is None or self.tp_group.is_driver

    def run(self, input_ids: torch.Tensor, carried: torch.Tensor | None, positions: torch.Tensor,
            meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Stage 0 starts from input_ids [n], the others from carried (hidden, residual) [2, n, D].
        Returns (hidden, residual) [2, n, D] for the next stage, or on the last the final hidden [n, D]."""
        m = self.inner
        attend = PagedAttention(m.kernels, meta, kv_cache, m.scale)
        if carried is None:
            hidden, residual = m.embed_tokens(input_ids), None  # [n, D]
        else:
            hidden, residual = carried[0], carried[1]
        with token_kinds_of(meta.generated_rows):  # int4: each token kind on its kernel, as one process
            for layer in m.layers:
                hidden, residual = layer(hidden, residual, positions, attend)
        if self.layout.is_last:
            return m.kernels.add_rms_norm(hidden, residual, m.final_norm, m.config.rms_norm_eps)[0]
        return torch.stack((hidden, residual))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Last stage: hidden [n, D] -> logits [n, V] fp32 on the stage leader (None on the others)."""
        if self.tp_group is None:
            return self.inner.compute_logits(hidden)
        return self.inner.gather_logits(hidden.contiguous())

    @property
    def logits_rank(self) -> int:
        """The rank that sends rank 0 the logits: the last stage's leader."""
        return self.group.size - self.tp


def split_micro_batches(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        k: int) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
    """A decode-only step's B rows cut into min(k, B) contiguous micro-batches (sizes differ by at
    most one); any other step whole."""
    b = meta.num_decode_tokens
    if meta.prefills or k <= 1 or b <= 1:
        return [(input_ids, positions, meta)]
    parts = []
    for rows in torch.arange(b).tensor_split(min(k, b)):
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        parts.append((input_ids[lo:hi], positions[lo:hi], AttentionMetadata(
            slot_mapping=meta.slot_mapping[lo:hi], num_decode_tokens=hi - lo,
            decode_block_tables=meta.decode_block_tables[lo:hi], decode_context_lens=meta.decode_context_lens[lo:hi],
            prefills=(), generated_rows=None if meta.generated_rows is None else meta.generated_rows[lo:hi])))
    return parts


@torch.inference_mode()
def pipeline_step(model: StageModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_cache: torch.Tensor, k: int) -> torch.Tensor | None:
    """This stage's part of one step (every rank calls it with the same inputs). Returns, on rank
    0, the logits [N, V] of a decode-only step (every row samples); else None."""
    group, layout, stats = model.group, model.layout, model.stats
    start = time.perf_counter()
    d, dtype, tp = model.full_config.hidden_size, model.dtype, model.tp
    parts = split_micro_batches(input_ids, positions, meta, k)
    decode_only = not meta.prefills
    pending: list = []  # (tensor, work): sends in flight, their tensors kept alive
    finals = []
    for j, (ids, pos, m) in enumerate(parts):
        carried = None
        if not layout.is_first:
            # from the same tensor-parallel rank of the previous stage (the states are replicated in a stage)
            carried = group.recv(torch.empty((2, ids.numel(), d), dtype=dtype, device=group.device), group.rank - tp, j)
        t0 = time.perf_counter()
        out = model.run(ids, carried, pos, m, kv_cache)
        if layout.is_last and decode_only:
            out = model.compute_logits(out)  # [n, V] fp32 on the stage leader, None on its other ranks
        stats.busy_s += time.perf_counter() - t0
        if not layout.is_last:
            pending.append((out, group.isend(out, group.rank + tp, j)))
        elif decode_only:
            if out is not None:
                out = out.contiguous()
                pending.append((out, group.isend(out, 0, LOGITS_TAG + j)))
        else:
            finals.append(out)
    model.kept = torch.cat(finals) if finals else None
    logits = None
    if group.is_driver and decode_only:
        v = model.full_config.vocab_size
        logits = torch.cat([group.recv(torch.empty((ids.numel(), v), dtype=torch.float32, device=group.device),
                                       model.logits_rank, LOGITS_TAG + j) for j, (ids, _, _) in enumerate(parts)])
    for _, work in pending:
        work.wait(group.timeout)
    stats.step_s += time.perf_counter() - start
    stats.steps += 1
    return logits


def stats_tensor(stats: StageStats, device: torch.device) -> torch.Tensor:
    return torch.tensor([stats.busy_s, stats.step_s, float(stats.steps)], dtype=torch.float64, device=device)


class PipelineDriver:
    """Rank 0's model: LlamaModel's interface over the stages (ModelRunner needs no change)."""

    def __init__(self, model: StageModel, channel: Channel, micro_batches: int, micro_batch_rows: int = 1) -> None:
        self.model, self.channel = model, channel
        self.config = model.full_config
        self.kernels = model.kernels
        self.micro_batches = micro_batches  # a decode step's pieces at most; may be changed between steps
        self.micro_batch_rows = micro_batch_rows  # and none of fewer rows
        self._logits: torch.Tensor | None = None  # the last decode-only step's [N, V]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The step through every stage; returns row handles [N, 1] (row i holds i) for compute_logits, or
        those of `output_rows` [R] (every stage computes every row)."""
        group = self.model.group
        payload = pack_step(input_ids, positions, meta).to(group.device)
        k = max(1, min(self.micro_batches, meta.num_decode_tokens // self.micro_batch_rows))
        with self.channel.lock:
            self.channel.send(Op.STEP, payload.numel(), k)
            group.broadcast(payload)
            self._logits = pipeline_step(self.model, input_ids, positions, meta, kv_cache.local, k)
        handles = torch.arange(input_ids.numel(), dtype=torch.float32, device=input_ids.device).unsqueeze(1)
        return handles if output_rows is None else handles[output_rows]

    @torch.inference_mode()
    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [S, 1] (rows of forward's handles) -> their logits [S, V] in fp32."""
        idx = rows[:, 0].long()
        if self._logits is not None:  # a decode-only step: the last stage sent them in the pipeline
            return self._logits[idx]
        v, group = self.config.vocab_size, self.model.group
        if idx.numel() == 0:
            return torch.empty((0, v), dtype=torch.float32, device=rows.device)
        with self.channel.lock:
            self.channel.send(Op.LOGITS, idx.numel())
            group.broadcast(idx.to(group.device).contiguous())
            out = group.recv(torch.empty((idx.numel(), v), dtype=torch.float32, device=group.device),
                             self.model.logits_rank, LOGITS_TAG)
        return out.to(rows.device)

    def stage_stats(self, reset: bool = False) -> list[StageStats]:
        """Every stage's StageStats, in stage order (then zeroed, with `reset`)."""
        group = self.model.group
        with self.channel.lock:
            self.channel.send(Op.STATS, int(reset))
            parts = group.gather(stats_tensor(self.model.stats, group.device))
        if reset:
            self.model.stats = StageStats()
        assert parts is not None
        return [StageStats(float(p[0]), float(p[1]), int(p[2])) for p in parts]


@torch.inference_mode()
def serve_stage(model: StageModel, kv_cache: torch.Tensor, group: TPGroup) -> None:
    """A follower stage's loop: rank 0's commands until STOP; a failed collective raises."""
    while True:
        op, a, b, _ = recv_header(group)
        if op is Op.STEP:
            flat = group.broadcast(torch.empty(a, dtype=torch.long, device=group.device))
            pipeline_step(model, *unpack_step(flat), kv_cache, b)
        elif op is Op.LOGITS:
            idx = group.broadcast(torch.empty(a, dtype=torch.long, device=group.device))
            if model.layout.is_last:
                assert model.kept is not None, "LOGITS without a step's hidden states"
                logits = model.compute_logits(model.kept[idx])
                if logits is not None:
                    group.send(logits.contiguous(), 0, LOGITS_TAG)
        elif op is Op.PUT_BLOCK:
            group.recv(kv_cache[a], 0)  # its layers of the block, straight into its cache
        elif op is Op.GET_BLOCK:
            group.send(kv_cache[a].contiguous(), 0)
        elif op is Op.STATS:
            group.gather(stats_tensor(model.stats, group.device))
            if a:
                model.stats = StageStats()
        elif op is Op.STOP:
            return
