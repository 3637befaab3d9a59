"""GPTQ's int32 packing of b-bit codes (b in 4, 8): 32 / b codes per int32 word, lowest bits first.

qweight packs along the input dim (rows of the [in, out] code matrix): word r of column j holds
codes[r * P + k, j] at bit offset k * b (P = 32 / b). qzeros packs along the output dim the same
way. When the packed dim is not a multiple of P, the last word is padded with zero codes (the
unpackers take the first n values back); AutoGPTQ checkpoints always divide exactly.
"""

from __future__ import annotations

import torch


def per_word(bits: int) -> int:
    return 32 // bits


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 with the same bits (two's complement wrap)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [n, m] ints in [0, 2**bits) -> int32 [ceil(n / P), m]."""
    p = per_word(bits)
    n, m = codes.shape
    words = -(-n // p)
    padded = torch.zeros(words * p, m, dtype=torch.int64)
    padded[:n] = codes.to(torch.int64)
    shifts = (torch.arange(p, dtype=torch.int64) * bits).view(1, p, 1)
    return _to_int32((padded.view(words, p, m) << shifts).sum(dim=1))


def unpack_rows(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int32 [W, m] -> codes int32 [n, m] (n <= W * P)."""
    p = per_word(bits)
    shifts = (torch.arange(p, dtype=torch.int32, device=packed.device) * bits).view(1, p, 1)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [W, P, m]
    return codes.reshape(-1, packed.shape[1])[:n]


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [n, m] -> int32 [n, ceil(m / P)]."""
    return pack_rows(codes.t(), bits).t().contiguous()


def unpack_cols(packed: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """int32 [n, W] -> codes int32 [n, m]."""
    return unpack_rows(packed.t(), bits, m).t().contiguous()
