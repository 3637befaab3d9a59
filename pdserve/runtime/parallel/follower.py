"""Ranks 1..N-1 of a tensor- or pipeline-parallel worker: load, join the group, run what rank 0
sends, exit.

Started by `launch.start_followers` as `python -m pdserve.runtime.parallel.follower` with its
`RankSpec` as JSON on stdin (data only: nothing a peer sends is executed). It loads the same
checkpoint as rank 0 (and keeps only its shard: its heads, or its stage's layers), joins the
group, then loops on rank 0's commands (`protocol.Op`) until STOP. It exits when rank 0
goes, however: STOP; a failed collective (rank 0's sockets closed, or the collective timeout,
which rank 0's heartbeat keeps from firing while it merely idles); or its parent's death (SIGTERM
through `parent_watch`). Exit status 0 after STOP, 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from dataclasses import dataclass

import torch

from pdserve import thread_policy
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.parallel.group import ParallelConfig, TPGroup, init_group
from pdserve.runtime.parallel.kv_shard import receive_block
from pdserve.runtime.parallel.pp_model import StageModel, serve_stage
from pdserve.runtime.parallel.protocol import Op, recv_bytes, recv_header, unpack_step
from pdserve.runtime.parallel.tp_model import TensorParallelModel

log = logging.getLogger("pdserve.tp")


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What one follower rank needs: the checkpoint, the engine's settings, its place in the group."""

    model_path: str
    engine: EngineConfig
    parallel: ParallelConfig
    rendezvous_dir: str
    rank: int
    threads: int = 0  # torch CPU threads (0: torch's default)
    log_level: str = "INFO"


def spec_to_json(spec: RankSpec) -> bytes:
    """The spec as JSON: plain values only, read back by `spec_from_json`."""
    return json.dumps(dataclasses.asdict(spec)).encode()


def spec_from_json(data: bytes) -> RankSpec:
    fields = json.loads(data)
    engine = fields["engine"]
    engine = EngineConfig(**{**engine, "cache": CacheConfig(**engine["cache"]),
                             "scheduler": SchedulerConfig(**engine["scheduler"])})
    return RankSpec(**{**fields, "engine": engine, "parallel": ParallelConfig(**fields["parallel"])})


def load_shard(spec: RankSpec) -> tuple[TensorParallelModel | StageModel, torch.Tensor, TPGroup]:
    """Loads the checkpoint, joins the group, keeps this rank's shard (its heads, or its stage's
    layers) and allocates its KV cache."""
    from pdserve.runtime.kv_cache import allocate_kv_cache
    from pdserve.runtime.loader import load_checkpoint
    from pdserve.runtime.parallel.stages import rank_weights

    checkpoint = load_checkpoint(spec.model_path, dtype=getattr(torch, spec.engine.dtype))
    weights = rank_weights(checkpoint, spec.engine, spec.parallel)
    group = init_group(spec.rendezvous_dir, spec.rank, spec.parallel.world_size, spec.engine.device,
                       spec.parallel.collective_timeout_s, stage_size=spec.parallel.tensor_parallel_size)
    if spec.parallel.pipeline_parallel_size > 1:
        model = StageModel(checkpoint.config, weights, group, group.device, tp_group=group.stage_group,
                           engine=spec.engine)
    else:
        model = TensorParallelModel(checkpoint.config, weights, group, group.device)
    del checkpoint, weights  # only the shard stays
    return model, allocate_kv_cache(model.config, spec.engine.cache, str(group.device)), group


@torch.inference_mode()
def serve(model: TensorParallelModel, kv_cache: torch.Tensor, group: TPGroup) -> None:
    """Runs rank 0's commands until STOP; a failed collective raises."""
    d, dtype = model.full_config.hidden_size, model.embed.dtype
    canonical = (*kv_cache.shape[1:-2], model.full_config.num_kv_heads, kv_cache.shape[-1])
    while True:
        op, a, b, _ = recv_header(group)
        if op is Op.STEP:
            flat = group.broadcast(torch.empty(a, dtype=torch.long, device=group.device))
            model.forward(*unpack_step(flat), kv_cache)
        elif op is Op.LOGITS:
            hidden = recv_bytes(group, a * d * dtype.itemsize, dtype, (a, d))
            model.gather_logits(hidden)
        elif op is Op.PUT_BLOCK:
            receive_block(kv_cache, group, a, b, model.layout.kv_heads, canonical)
        elif op is Op.GET_BLOCK:
            group.gather(kv_cache[a].contiguous())
        elif op is Op.STOP:
            return


def run(spec: RankSpec) -> int:
    # A rank computes on this thread: out of SCHED_BATCH if its worker's threads ran there when it
    # started it (pdserve.thread_policy), before torch's OpenMP team exists.
    thread_policy.run_as_compute_thread()
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, kv_cache, group = load_shard(spec)
    if isinstance(model, StageModel):
        log.info("rank %d/%d ready: stage %d, layers %s", spec.rank, group.size, model.layout.stage,
                 model.layout.layers)
    else:
        log.info("rank %d/%d ready: heads %s, KV heads %s", spec.rank, group.size, model.layout.heads,
                 model.layout.kv_heads)
    try:
        (serve_stage if isinstance(model, StageModel) else serve)(model, kv_cache, group)
    except Exception as exc:  # noqa: BLE001 - rank 0 is gone or broke the group: nothing left to serve
        log.warning("rank %d: leaving the group: %s", spec.rank, str(exc).splitlines()[0] if str(exc) else exc)
        return 1
    group.close()
    return 0


def main() -> int:
    from pdserve import parent_watch

    parent_watch.arm()
    spec = spec_from_json(sys.stdin.buffer.read())
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    try:
        return run(spec)
    finally:  # rank 0 removes it once all are connected; not if it was killed before that
        shutil.rmtree(spec.rendezvous_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
