"""Starting a tensor-parallel engine: the follower ranks, rank 0's group, the driver in the Engine.

`tensor_parallel_engine` is what a worker calls (through `pdserve.engine_args`): it checks the
degree against the checkpoint (a one-line error naming the valid sizes, before anything starts),
starts ranks 1..N-1 (they load while rank 0 does), builds rank 0's Engine, joins the group, and
puts the driver and the sharded cache where the Engine's model and cache were (`attach`). The
Engine, its scheduler and ModelRunner are unchanged: they see a model with LlamaModel's interface
and a cache whose blocks copy in and out in the canonical layout. With a pipeline-parallel size
above 1 the ranks are stages instead (`attach_pipeline`: stage 0's driver and cache, pp_model and
pp_kv), each a tensor-parallel group of its own when both sizes are above 1.

`RankProcesses` watches the followers: one that exits while the worker runs is reported to
`on_rank_exit` (the worker takes itself down), and `close` stops them all (STOP, then SIGKILL for
any that do not exit in time). No process outlives the worker: the followers also watch it
(`parent_watch`) and exit when a collective fails.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.runtime.config import EngineConfig
from pdserve.runtime.parallel.follower import RankSpec, spec_to_json
from pdserve.runtime.parallel.group import ParallelConfig, TPGroup, init_group
from pdserve.runtime.parallel.kv_shard import ShardedKVCache
from pdserve.runtime.parallel.pp_kv import PipelineKVCache
from pdserve.runtime.parallel.pp_model import PipelineDriver, StageModel
from pdserve.runtime.parallel.protocol import Channel
from pdserve.runtime.parallel.stages import check_stages
from pdserve.runtime.parallel.sharding import ShardingError, check_degree, kv_head_owners, shard_layout
from pdserve.runtime.parallel.tp_model import DriverModel, TensorParallelModel

__all__ = ["ShardingError", "TensorParallelHandle", "serve_with_ranks", "tensor_parallel_engine"]
log = logging.getLogger(__name__)
STOP_WAIT_S = 10.0  # a follower that has not exited this long after STOP is killed


class RankProcesses:
    """The follower ranks of one worker (child processes), watched until `close`."""

    def __init__(self, procs: list[subprocess.Popen], rendezvous_dir: str, pipe_w: int) -> None:
        self.procs, self.rendezvous_dir, self._pipe_w = procs, rendezvous_dir, pipe_w
        self.closing = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def check_alive(self) -> None:
        """RuntimeError naming the first rank that has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {proc.returncode} while "
                                   f"starting (its log is above)")

    def watch(self, on_rank_exit: Callable[[int, int], None]) -> None:
        """Calls on_rank_exit(rank, returncode) (on a watcher thread) for a rank that exits before `close`."""
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._wait, args=(rank, proc, on_rank_exit), daemon=True,
                             name=f"tp-rank{rank}-watch").start()

    def _wait(self, rank: int, proc: subprocess.Popen, on_rank_exit: Callable[[int, int], None]) -> None:
        code = proc.wait()
        if not self.closing:
            log.error("tensor-parallel rank %d (pid %d) exited with status %d", rank, proc.pid, code)
            on_rank_exit(rank, code)

    def remove_rendezvous(self) -> None:
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)

    def close(self, wait_s: float = STOP_WAIT_S) -> None:
        self.closing = True
        for proc in self.procs:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._pipe_w >= 0:
            os.close(self._pipe_w)
            self._pipe_w = -1
        self.remove_rendezvous()


def start_followers(model_path: str, engine: EngineConfig, parallel: ParallelConfig, threads: int = 0,
                    log_level: str = "INFO") -> RankProcesses:
    """Starts ranks 1..N-1 (one process each); they load the checkpoint and wait in the group."""
    from pdserve.parent_watch import supervisor_env

    rendezvous = tempfile.mkdtemp(prefix="pdserve-tp-")
    read_fd, write_fd = os.pipe()  # never written: EOF tells a follower its worker is gone
    env = os.environ | supervisor_env(read_fd, pdeathsig=threading.current_thread() is threading.main_thread())
    procs = []
    try:
        for rank in range(1, parallel.world_size):
            spec = RankSpec(str(model_path), engine, parallel, rendezvous, rank, threads, log_level)
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.runtime.parallel.follower"],
                                    stdin=subprocess.PIPE, env=env, pass_fds=(read_fd,))
            procs.append(proc)
            proc.stdin.write(spec_to_json(spec))
            proc.stdin.close()
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    finally:
        os.close(read_fd)
    return RankProcesses(procs, rendezvous, write_fd)


@dataclass
class TensorParallelHandle:
    """Rank 0's side of a running group: close it when the worker stops."""

    group: TPGroup
    channel: Channel
    ranks: RankProcesses
    model: TensorParallelModel

    def close(self) -> None:
        # STOP only to a whole group: a send to a dead rank may wait out the collective timeout,
        # and the live ones leave anyway when their next collective fails.
        self.channel.close(send_stop=self.ranks.all_alive())
        self.ranks.close()
        self.group.close()


def attach(engine, weights: dict, group: TPGroup,
           parallel: ParallelConfig) -> tuple[Channel, TensorParallelModel | StageModel]:
    """Replaces `engine`'s model and KV cache by rank 0's driver and sharded cache."""
    from pdserve.runtime.kv_cache import allocate_kv_cache

    if parallel.pipeline_parallel_size > 1:
        return attach_pipeline(engine, weights, group, parallel)
    config = engine.model_config
    model = TensorParallelModel(config, weights, group, group.device)
    channel = Channel(group, heartbeat_s=parallel.collective_timeout_s / 4)
    local = allocate_kv_cache(model.config, engine.config.cache, str(group.device))
    kv = ShardedKVCache(local, channel, model.layout.kv_heads, kv_head_owners(config, group.size))
    engine.runner.graphs = None  # captured (on a GPU) over the whole model: not this one
    engine.runner.model, engine.runner.kv_cache, engine.kv_cache = DriverModel(model, channel), kv, kv
    return channel, model


def attach_pipeline(engine, weights: dict, group: TPGroup, parallel: ParallelConfig) -> tuple[Channel, StageModel]:
    """Replaces `engine`'s model and KV cache by stage 0's pipeline driver and its layers' cache."""
    from pdserve.runtime.kv_cache import allocate_kv_cache

    config, tp = engine.model_config, parallel.tensor_parallel_size
    model = StageModel(config, weights, group, group.device, tp_group=group.stage_group, engine=engine.config)
    channel = Channel(group, heartbeat_s=parallel.collective_timeout_s / 4)
    local = allocate_kv_cache(model.config, engine.config.cache, str(group.device))
    heads = [shard_layout(config, t, tp).kv_heads for t in range(tp)]
    kv = PipelineKVCache(local, channel, model.layout.ranges, heads, kv_head_owners(config, tp))
    driver = PipelineDriver(model, channel, parallel.micro_batches or parallel.pipeline_parallel_size,
                            parallel.micro_batch_rows)
    engine.runner.graphs = None
    engine.runner.model, engine.runner.kv_cache, engine.kv_cache = driver, kv, kv
    return channel, model


def check_split(config, parallel: ParallelConfig) -> None:
    """ShardingError (one line naming the valid sizes) unless `parallel` splits the model `config`."""
    check_degree(config, parallel.tensor_parallel_size)
    check_stages(config, parallel.pipeline_parallel_size)


def tensor_parallel_engine(model_path, engine_config: EngineConfig, parallel: ParallelConfig,
                           fingerprint: Callable[[str], str] | None = None, threads: int = 0,
                           log_level: str = "INFO", **engine_kwargs):
    """(Engine, TensorParallelHandle) of `parallel.world_size` ranks on the checkpoint at
    `model_path`; `fingerprint` maps the checkpoint's fingerprint to the engine's (compute dtype).
    `threads`: torch CPU threads of every rank, this process's included (0: the cores / ranks);
    with `parallel.pipeline_parallel_size` M > 1 the ranks are M pipeline stages instead;
    `engine_kwargs` go to Engine.from_checkpoint."""
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import inspect_checkpoint, load_checkpoint
    from pdserve.runtime.parallel.stages import rank_weights

    check_split(inspect_checkpoint(model_path).config, parallel)
    # Each rank's share of the cores: torch's default (all of them, in every rank) oversubscribes
    # the CPU, and ranks spinning on each other's collectives made steps 50x slower.
    threads = threads or max(1, (os.cpu_count() or 1) // parallel.world_size)
    if engine_config.device.startswith("cpu"):
        torch.set_num_threads(threads)
    engine_config = replace(engine_config, cuda_graph=False)  # graphs capture one device's whole model
    if engine_config.weight_format == "auto":  # ranks split dense (and GPTQ) weights, not packed codes
        engine_config = replace(engine_config, weight_format="dense")
    ranks = start_followers(model_path, engine_config, parallel, threads, log_level)
    try:
        checkpoint = load_checkpoint(model_path, dtype=getattr(torch, engine_config.dtype))
        fp = fingerprint(checkpoint.fingerprint) if fingerprint else checkpoint.fingerprint
        engine = Engine.from_checkpoint(checkpoint, engine_config, fp, **engine_kwargs)
        group = init_group(ranks.rendezvous_dir, 0, parallel.world_size, engine_config.device,
                           parallel.collective_timeout_s, check=ranks.check_alive,
                           stage_size=parallel.tensor_parallel_size)
        ranks.remove_rendezvous()  # all ranks are connected; nothing is left behind if this process is killed
        channel, model = attach(engine, rank_weights(checkpoint, engine_config, parallel), group, parallel)
    except BaseException:
        ranks.closing = True
        for proc in ranks.procs:
            proc.kill()
        ranks.close(wait_s=1.0)
        raise
    return engine, TensorParallelHandle(group, channel, ranks, model)


def serve_with_ranks(handle: TensorParallelHandle) -> None:
    """A worker's ties to its ranks: one that exits takes the worker down (SIGTERM to itself, its
    ordinary stop: the engine has failed already, its calls answer UNAVAILABLE, and the gateway
    resumes its streams elsewhere as for any dead worker); the ranks are stopped when it exits."""
    def rank_exited(rank: int, code: int) -> None:
        log.error("tensor-parallel rank %d is gone (status %d): stopping this worker", rank, code)
        os.kill(os.getpid(), signal.SIGTERM)

    handle.ranks.watch(rank_exited)
    atexit.register(handle.close)
