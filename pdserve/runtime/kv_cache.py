"""The paged KV cache tensor: one block of one sequence is one contiguous slab.

Layout `[num_blocks, layers, 2, rows, KVH, D]` (2 = keys, values), so a block is a single value
in the KV store and a single copy on the wire. For float formats rows = block_size.

Scaled formats (`int8`, `fp8_e4m3`) store codes plus one fp32 scale per (block, layer, k/v,
head): rows = block_size + 1, and the extra row `block_size` holds head h's scale in the first
4 bytes of its D-byte slot (so D must be a multiple of 4). Keeping the scales inside the block's
slab means a block still moves as one tensor: export/import copies, the wire and the KV store
need no second array, and bytes per token are measured from the tensor like any other format.
value ~= code * scale; int8 codes are in [-127, 127], fp8 codes are e4m3 values in [-448, 448].
"""

from __future__ import annotations

import mmap
import math

import torch

from pdserve.runtime.config import ConfigError, CacheConfig, ModelConfig

# --kv-dtype name -> storage dtype of the cache tensor.
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Storage dtypes of the scaled formats -> the largest code magnitude.
SCALED_QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def dtype_of(name: str) -> torch.dtype:
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r} (supported: {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


def format_name(dtype: torch.dtype) -> str:
    """The --kv-dtype name of a storage dtype (str(dtype) for one that has none)."""
    return next((n for n, d in KV_DTYPES.items() if d == dtype), str(dtype))


def is_scaled(dtype: torch.dtype) -> bool:
    return dtype in SCALED_QMAX


def cache_rows(block_size: int, dtype: torch.dtype) -> int:
    """Rows of one (block, layer, k/v) slab: the tokens, plus the scale row of a scaled format."""
    return block_size + 1 if is_scaled(dtype) else block_size


def block_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    """Shape of one block: [layers, 2, rows, KVH, D]."""
    rows = cache_rows(cache.block_size, dtype_of(cache.dtype))
    return (model.num_layers, 2, rows, model.num_kv_heads, model.head_dim)


def allocate_kv_cache(model: ModelConfig, cache: CacheConfig, device: str) -> torch.Tensor:
    dtype = dtype_of(cache.dtype)
    if is_scaled(dtype) and model.head_dim % 4:
        raise ConfigError(f"--kv-dtype {cache.dtype} needs a head dim that is a multiple of 4 "
                          f"(the scale row holds an fp32 per head), got {model.head_dim}")
    shape = (cache.num_blocks, *block_shape(model, cache))
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    check_fits(cache.num_blocks, math.prod(shape[1:]) * dtype.itemsize)
    try:
        return zero_pages(shape, dtype)
    except OSError as e:  # the kernel refused the mapping outright (more than memory and swap)
        raise ConfigError(f"--num-blocks {cache.num_blocks}: the KV cache cannot be mapped ({e}); lower it") from e


def check_fits(num_blocks: int, block_bytes: int, available: int | None = None) -> None:
    """ConfigError when `num_blocks` blocks would take more than the memory available now: the pages
    are taken as blocks are written (`zero_pages`), so such a cache would start and the OOM killer
    would end the worker once its blocks filled it, mid-stream."""
    available = memory_available() if available is None else available
    if available is None or num_blocks * block_bytes <= available:
        return
    gib = 1 << 30
    raise ConfigError(f"--num-blocks {num_blocks}: the KV cache would take {num_blocks * block_bytes / gib:.1f} GiB "
                      f"({block_bytes / (1 << 20):.2f} MiB a block), more than the {available / gib:.1f} GiB this "
                      f"machine has available; at most {available // block_bytes} blocks fit (fewer beside other "
                      f"processes)")


def memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor on memory the kernel hands out page by page as it is first written.

    Why: `torch.zeros` writes every byte, so a worker's default cache (SmolLM2: 4096 blocks of fp32,
    2.9 GB) was resident from its start, and zeroing it took a second of the start (a worker alone on
    a 2-core AMD EPYC; more with two workers starting at once). An anonymous private mapping reads as zeros (the kernel's guarantee, not the allocator's
    like `torch.empty`'s), and a page costs memory only once a block on it is written: a worker's RSS
    follows the blocks it has used (every block, once the prefix cache has filled it), not --num-blocks.
    The tensor keeps the mapping alive (torch.frombuffer holds a reference to its buffer)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)


def block_size_of(kv_cache: torch.Tensor) -> int:
    """Token slots per block of a cache tensor (its rows, less the scale row if scaled)."""
    rows = kv_cache.shape[-3]
    return rows - 1 if is_scaled(kv_cache.dtype) else rows


def kv_bytes_per_token(kv_cache: torch.Tensor) -> float:
    """Bytes one token's keys and values take in the cache, measured from the tensor (scales included)."""
    block = kv_cache[0]
    return block.numel() * block.element_size() / block_size_of(kv_cache)
