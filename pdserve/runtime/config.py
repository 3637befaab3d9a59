"""Configuration dataclasses of the runtime: model shape, KV cache, scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runtime.arch import ARCH_SPECS, ArchSpec

# --kv-dtype values (the cache formats of `pdserve.runtime.kv_cache`); int8 and fp8_e4m3 are
# codes with one scale per block and head. Here, free of torch, so that flag parsing stays light.
KV_DTYPE_NAMES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3")
# --dtype values: the compute dtype (weights and activations). "auto" is resolved once at start by
# `resolve_compute_dtype`: bfloat16 on a GPU or where the CPU runs it natively, else float32.
COMPUTE_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# --weight-format values: projections as dense float matrices, or as the GGUF file's codes packed
# for the CPU int4 kernels (torch's in bf16/fp16, ours in fp32): int4 (Q4_0/Q4_1/Q4_K codes, pdserve.quant.int4_cpu)
# or packed (also Q8_0/Q5_K as two 4-bit planes, Q6_K dequantized; pdserve.quant.gguf_packed);
# int4-exact: the 4-bit codes with the inputs unquantized (fp32: our W4A32 kernel instead of int4's
# int8 inputs, llama.cpp's method; bf16/fp16: torch's kernel without the few-row int8 path);
# auto: in bf16/fp16 on the CPU int4 when every projection is Q4_0/Q4_1, packed when all are
# packable; in fp32 on the CPU int4-exact when every projection is Q4_0/Q4_1; dense otherwise.
WEIGHT_FORMATS = ("auto", "dense", "int4", "int4-exact", "packed")
PACKED_WEIGHT_FORMATS = ("int4", "int4-exact", "packed")
FOUR_BIT_FORMATS = ("int4", "int4-exact")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architecture: str  # a key of arch.ARCH_SPECS: "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)

    def __post_init__(self) -> None:
        if self.architecture not in ARCH_SPECS:
            raise ConfigError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def arch(self) -> ArchSpec:
        """The architecture's spec: weight names and shapes, forward options."""
        return ARCH_SPECS[self.architecture]


def resolve_compute_dtype(name: str, device: str = "cpu") -> str:
    """The concrete compute dtype of a --dtype value ("auto": bfloat16 on a GPU, or on a CPU with
    AVX512-BF16 or AMX, which oneDNN runs natively; float32 elsewhere, where bf16 is emulated and slow)."""
    if name not in COMPUTE_DTYPE_NAMES:
        raise ConfigError(f"unknown compute dtype {name!r} (supported: {', '.join(COMPUTE_DTYPE_NAMES)})")
    if name != "auto":
        return name
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if _cpu_runs_bf16() else "float32"


def _cpu_runs_bf16() -> bool:
    import torch

    try:  # oneDNN's own check of the CPU flags (avx512_bf16 / amx_bf16)
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` tokens each."""

    block_size: int = 16
    num_blocks: int = 4096
    dtype: str = "float32"  # KV format, one of KV_DTYPE_NAMES

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_NAMES:
            raise ConfigError(f"unknown KV cache dtype {self.dtype!r} (supported: {', '.join(KV_DTYPE_NAMES)})")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How many sequences and tokens one engine step may take."""

    max_num_seqs: int = 32  # running sequences batched in one decode step
    max_num_batched_tokens: int = 512  # token budget of one step; longer prompts go in chunks
    max_waiting: int = 1024  # bounded queue: more waiting requests are refused

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("max_num_batched_tokens must be positive")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an Engine needs besides the weights."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    # Replay decode-only steps from CUDA graphs (runtime.cuda_graph); only on a GPU with the
    # CuPy kernels, ignored elsewhere. Off: every step eager (debugging, profiling).
    cuda_graph: bool = True
    # Compute dtype the weights were loaded in (a COMPUTE_DTYPE_NAMES value, resolved: not "auto").
    dtype: str = "float32"
    # The layers' projections (WEIGHT_FORMATS): "dense", or "int4"/"packed" codes for the CPU kernel
    # (the GGUF's own Q4_0/Q4_1 codes where it has them), or "auto". Read by Engine.from_checkpoint.
    weight_format: str = "auto"
    # Packed projections also keep their dequantized weight (Int4Linear.keep_dense_copy) for prefill
    # chunks and, in bf16 / fp16, decode steps of DENSE_COPY_FROM_ROWS or more rows: faster at the
    # dense weights' memory. Resolved by engine_args.dense_copy (--dense-copy).
    dense_copy: bool = False
    # With the dense copy, prompt rows of bf16 4-bit projections run the int8-input VNNI GEMM that
    # generated rows run, where it is kept (AVX512-VNNI, no AMX: Int4Linear.keep_dense_copy), instead of
    # the copy: a prompt token's projections 1.25x faster on Zen 4, at llama.cpp's arithmetic (its Q4_1
    # times Q8_1 inputs; README.md perplexity 51.27 against the copy's 51.15); there no copy is kept
    # (nothing reads it). Resolved by engine_args (--int8-prompts).
    int8_prompts: bool = False
    # Threads of the one-call C decode step (runtime.kernels.cpu_decode_step: decode steps of few
    # sequences on the CPU); 0: the engine thread's torch count, or under `pdserve up` the host's core
    # share's count of the moment (runtime.core_share). The step drops to one thread for a while when
    # it finds its cores taken (StepThreads).
    step_threads: int = 0
    # On the CPU, the loaded weights' memory collapsed into 2 MB pages (runtime.huge_pages: fewer TLB
    # misses in a step's weight reads). Off by default here (a test's many small engines gain nothing,
    # and each would rescan the process's mappings); on by default for the workers and the benchmarks
    # (engine_args: --huge-pages).
    huge_pages: bool = False

    def __post_init__(self) -> None:
        if self.step_threads < 0:
            raise ConfigError(f"step_threads must be 0 (torch's count) or positive, got {self.step_threads}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ConfigError(f"unknown weight format {self.weight_format!r} (one of {', '.join(WEIGHT_FORMATS)})")
        if self.weight_format in PACKED_WEIGHT_FORMATS and not self.device.startswith("cpu"):
            raise ConfigError(f"--weight-format {self.weight_format} runs on the CPU, not on {self.device}")
        if self.weight_format == "packed" and self.dtype not in ("bfloat16", "float16"):
            raise ConfigError(f"--weight-format packed runs with --dtype bfloat16 or float16 (torch's kernel for its "
                              f"two-plane codes is slow in float32), not --dtype {self.dtype}; --weight-format int4 "
                              f"runs in float32 too")
