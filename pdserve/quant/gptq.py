"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, each column's rounding
error pushed onto the columns not yet quantized, weighted by the inverse Hessian of the layer's
reconstruction loss ||W X - Q X||^2, whose Hessian is H = 2 X X^T (X: the layer's calibration inputs).

With U the upper Cholesky factor of H^-1 (H^-1 = U^T U), quantizing column i with error e and
updating the later columns by -e * U[i, i:] / U[i, i] is the optimal (OBS) compensation; doing it in
blocks of columns turns most of the updates into one matrix product per block ("lazy batch").
"""

from __future__ import annotations

import torch

from pdserve.quant.quantizer import QuantResult, group_params, quantize_codes
from pdserve.quant.spec import QuantError, QuantSpec

BLOCK_SIZE = 128  # columns per lazy-update block; a multiple of every group size we make


class HessianAccumulator:
    """H = 2/n sum x x^T over the n calibration rows seen so far, accumulated in float64."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        """x: [..., in] inputs of the layer."""
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum += (x.t() @ x).to(torch.float64)  # float32 product per batch, float64 running sum
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if not self.rows:
            raise QuantError("GPTQ needs calibration inputs: none reached this layer")
        return (2.0 / self.rows) * self.sum


def _inverse_cholesky(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1; the damping grows tenfold until H is positive definite."""
    mean_diag = torch.diag(h).mean().item()
    damp = damp_percent
    for _ in range(6):
        hd = h + damp * mean_diag * torch.eye(h.shape[0], dtype=h.dtype)
        chol, info = torch.linalg.cholesky_ex(hd)
        if info.item() == 0:
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if info.item() == 0:
                return upper
        damp *= 10
    raise QuantError(f"GPTQ: the Hessian is not positive definite even with damping {damp / 10:g}")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, damp_percent: float = 0.01) -> QuantResult:
    """w: [out, in], h: [in, in] -> codes/scales/zeros/g_idx as RTN would give, but error-compensated.

    Groups are consecutive columns in the order visited (activation order when spec.desc_act), so a
    group's scale is chosen from weights that already carry the compensation of earlier columns.
    """
    out, n = w.shape
    if h.shape != (n, n):
        raise QuantError(f"GPTQ: Hessian shape {tuple(h.shape)} does not match {n} input channels")
    g = spec.group_len(n)
    w = w.detach().to(torch.float64).clone()
    h = h.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs never active: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diag(h), descending=True) if spec.desc_act else torch.arange(n)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_cholesky(h, damp_percent)  # [n, n] upper

    codes = torch.zeros(out, n, dtype=torch.int64)
    scales, zeros = [], []
    if spec.group_size == -1:  # one group: parameters from the whole (uncompensated) row, as RTN
        scale, zero = group_params(w, spec)
        scales, zeros = [scale], [zero]
    block = BLOCK_SIZE if spec.group_size == -1 else max(BLOCK_SIZE // g, 1) * g
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        w_blk = w[:, b0:b1].clone()  # [out, B]
        err_blk = torch.zeros_like(w_blk)
        hinv_blk = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if spec.group_size != -1 and col % g == 0:
                # Groups never straddle blocks (block is a multiple of g), so w_blk holds them whole.
                scale, zero = group_params(w_blk[:, i:i + g], spec)
                scales.append(scale)
                zeros.append(zero)
            q = quantize_codes(w_blk[:, i:i + 1], scale, zero, spec.maxq)[:, 0]  # [out]
            codes[:, col] = q
            deq = (q - zero).to(torch.float64) * scale.to(torch.float64)
            err = (w_blk[:, i] - deq) / hinv_blk[i, i]
            w_blk[:, i:] -= err[:, None] * hinv_blk[i, i:][None, :]
            err_blk[:, i] = err
        w[:, b1:] -= err_blk @ hinv[b0:b1, b1:]

    inv = torch.argsort(perm)
    g_idx = (torch.arange(n) // g)[inv].to(torch.int32)  # group of each original input channel
    return QuantResult(codes[:, inv], torch.stack(scales).float(), torch.stack(zeros), g_idx)
