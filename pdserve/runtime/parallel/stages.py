"""Which layers a pipeline stage holds, and the weights it keeps of the checkpoint.

Stages hold contiguous layers, split so that the slowest stage is as fast as it can be (a
pipeline runs at its slowest stage's pace): the cost of a layer and of the output head are their
multiply-adds per token, and the last stage, which also runs the head, gets fewer layers (a
SmolLM2-sized model's 49152 x 576 head costs what 7.7 of its layers do: 19 + 11 layers at PP 2,
not 15 + 15). Any M up to the layer count splits. The embedding lives on stage 0 (a lookup: free),
the final norm and the output head on the last stage; a stage keeps
only its layers, renumbered from 0, so that it is a LlamaModel of its own (its KV cache holds only
its layers). A stage that needs neither the embedding nor the head gets a one-row placeholder
(LlamaModel's constructor wants the names), not the [V, D] matrix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.parallel.sharding import ShardingError


def stage_costs(config: ModelConfig) -> tuple[int, int]:
    """(a layer's, the head's) multiply-adds per token."""
    d, hd = config.hidden_size, config.head_dim
    attention = d * (config.num_heads + 2 * config.num_kv_heads) * hd + config.num_heads * hd * d
    return attention + 3 * d * config.intermediate_size, config.vocab_size * d


def stage_ranges(num_layers: int, stages: int, layer_cost: int = 1, head_cost: int = 0) -> list[tuple[int, int]]:
    """[first, end) layer of each stage: contiguous, at least one each, the largest stage cost
    (its layers, and the head on the last) as small as it can be; ties go to the even split.
    Equal costs and no head: layers [s*L//M, (s+1)*L//M)."""
    def cost(a: int, b: int, last: bool) -> int:
        return (b - a) * layer_cost + (head_cost if last else 0)

    # best[s][i]: the smallest largest cost of stages 0..s over layers [0, i); a small DP (L <= ~100).
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages)]
    cut = [[0] * (num_layers + 1) for _ in range(stages)]
    for i in range(1, num_layers + 1):
        best[0][i] = cost(0, i, stages == 1)
    for s in range(1, stages):
        for i in range(s + 1, num_layers + 1):
            for j in range(s, i):
                c = max(best[s - 1][j], cost(j, i, s == stages - 1))
                even = abs(j - s * num_layers // stages) < abs(cut[s][i] - s * num_layers // stages)
                if c < best[s][i] or (c == best[s][i] and even):
                    best[s][i], cut[s][i] = c, j
    ends = [num_layers]
    for s in range(stages - 1, 0, -1):
        ends.append(cut[s][ends[-1]])
    starts = [0, *reversed(ends[1:])]
    return list(zip(starts, reversed(ends)))


def check_stages(config: ModelConfig, stages: int) -> None:
    """ShardingError unless every one of `stages` stages gets a layer."""
    if not 1 <= stages <= config.num_layers:
        raise ShardingError(f"--pipeline-parallel-size {stages} does not split this model ({config.num_layers} "
                            f"layers): valid sizes are 1 to {config.num_layers}")


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Stage `stage` of `stages`: its layers, and every stage's (for blocks in the canonical layout)."""

    stage: int
    stages: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def layers(self) -> tuple[int, int]:
        return self.ranges[self.stage]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def stage_layout(config: ModelConfig, stage: int, stages: int) -> StageLayout:
    check_stages(config, stages)
    return StageLayout(stage, stages, tuple(stage_ranges(config.num_layers, stages, *stage_costs(config))))


def stage_config(config: ModelConfig, layout: StageLayout) -> ModelConfig:
    a, b = layout.layers
    return dataclasses.replace(config, num_layers=b - a)


def stage_weights(config: ModelConfig, weights: dict, layout: StageLayout) -> dict:
    """The stage's weights (HF names, layers renumbered from 0); the tensors are shared, not copied."""
    arch = config.arch
    a, b = layout.layers
    out = {}
    for i in range(a, b):
        for t in arch.layer_tensors:
            name = arch.layer_name(i, t.role)
            if name in weights:
                out[arch.layer_name(i - a, t.role)] = weights[name]
    embed, head, norm = (arch.global_name(r) for r in ("embed", "lm_head", "final_norm"))
    e = weights[embed]  # a tensor, or the 8-bit head where tied (quant.q8_head.Q8Head: its dtype the compute's)
    placeholder = torch.zeros((1, e.shape[1]), dtype=e.dtype, device=getattr(e, "device", "cpu"))
    out[embed] = e if layout.is_first else placeholder
    if layout.is_last:
        out[head] = weights.get(head, e)
    out[norm] = weights[norm]
    return out


def pipeline_weights(checkpoint, engine: EngineConfig, tensor_parallel_size: int) -> dict:
    """The weights of the whole model as every rank of a pipeline loads them: one process's engine's
    (`engine_weights`: the head kept 8-bit where it keeps it), but where tensor parallelism splits the
    vocabulary over a stage's ranks (the head then stays a matrix to split: `weights_for`'s)."""
    from pdserve.quant.int4_codes import engine_weights, weights_for

    return (weights_for if tensor_parallel_size > 1 else engine_weights)(checkpoint, engine)[0]


def rank_weights(checkpoint, engine: EngineConfig, parallel) -> dict:
    """What a rank of a parallel group loads before it keeps its shard: a pipeline's ranks
    `pipeline_weights` (packed as one process's engine packs them), tensor parallelism alone
    `weights_for`'s. `parallel`: its ParallelConfig. Rank 0 and the followers both call it."""
    from pdserve.quant.int4_codes import weights_for

    if parallel.pipeline_parallel_size > 1:
        return pipeline_weights(checkpoint, engine, parallel.tensor_parallel_size)
    return weights_for(checkpoint, engine)[0]
