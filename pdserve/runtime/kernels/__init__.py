"""The kernel interface of the runtime, chosen in one place.

Every kernel exists as a torch implementation (`torch_ops`, the CPU path and the reference);
CUDA implementations with the same signatures plug in through `get_kernels` for CUDA devices.
Shapes (N = tokens in the step, H = query heads, KVH = kv heads, D = head dim):
the paged KV cache is `[num_blocks, layers, 2, block_size, KVH, D]`.
"""

from __future__ import annotations

from types import ModuleType

from pdserve.runtime.kernels import torch_ops

KERNEL_NAMES = (
    "rms_norm",
    "add_rms_norm",
    "apply_rope",
    "silu_and_mul",
    "write_kv",
    "paged_decode_attention",
    "prefill_attention",
)


def get_kernels(device: str) -> ModuleType:
    """Returns the module of kernels for `device`: torch ops on the CPU (decode attention in C where it builds)."""
    if device.startswith("cuda"):
        try:
            from pdserve.runtime.kernels import cuda_ops  # noqa: PLC0415 (needs cupy)
        except ImportError:
            return torch_ops
        return cuda_ops
    from pdserve.runtime.kernels import cpu_attention  # noqa: PLC0415

    cpu_attention.library()  # built (about a second, once per machine) with the model, not in its first step
    return torch_ops
