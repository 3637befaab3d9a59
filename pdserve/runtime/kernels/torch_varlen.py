"""Torch reference of packed variable-length prefill attention (the CUDA kernel's counterpart).

Kept out of `torch_ops` because the runtime calls the per-sequence `prefill_attention`; this
is the packed form that the CUDA kernel also offers (one launch for all prefill sequences),
defined here by looping the per-sequence reference so the two can never disagree.
"""

from __future__ import annotations

import torch

from pdserve.runtime.kernels import torch_ops


def prefill_attention_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of several sequences' new tokens, packed in one batch.

    q: [N, H, D] with sequence s owning rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1];
    context_lens: [S] (cached prefix + new tokens); block_tables: [S, MB] -> out [N, H, D].
    The new tokens' keys and values must already be written into the cache.
    """
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for s, ctx in enumerate(lens):
        start, end = bounds[s], bounds[s + 1]
        if end > start:
            out[start:end] = torch_ops.prefill_attention_torch(
                q[start:end], kv_cache, layer, block_tables[s], int(ctx), scale)
    return out
