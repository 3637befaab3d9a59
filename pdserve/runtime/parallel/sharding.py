"""What one tensor-parallel rank holds, and splitting the checkpoint's weights to it.

Rank r of N holds query heads [r*H/N, (r+1)*H/N) and the KV heads they read: its own KVH/N of
them when N divides KVH, else (N a multiple of KVH) the one KV head of its group, replicated on
N/KVH ranks. q/k/v and gate/up are split by output rows (column-parallel: each rank computes its
heads and its slice of the MLP with no communication), o and down by input columns
(row-parallel: partial sums, one all-reduce each). The embedding and the head are split by
vocabulary rows, padded to equal shards so that logits gather without ragged sizes. Norms are
replicated. GPTQ weights split along their packing: output columns directly (zero points are
unpacked and repacked), input rows on whole packed words, keeping the groups those rows use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.packing import pack_cols, per_word, unpack_cols
from pdserve.runtime.config import ConfigError, ModelConfig


class ShardingError(ConfigError):
    """The model cannot be split this way; the one-line message says what would work."""


def valid_degrees(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes that split `config` evenly: they divide the heads and the MLP, and
    divide the KV heads or are a multiple of them."""
    h, kvh, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    return [n for n in range(1, h + 1)
            if h % n == 0 and inter % n == 0 and (kvh % n == 0 or n % kvh == 0)]


def check_degree(config: ModelConfig, size: int) -> None:
    """ShardingError unless `size` ranks split `config` evenly."""
    if size not in valid_degrees(config):
        raise ShardingError(
            f"--tensor-parallel-size {size} does not split this model ({config.num_heads} attention heads, "
            f"{config.num_kv_heads} KV heads, MLP {config.intermediate_size}): valid sizes are "
            f"{', '.join(map(str, valid_degrees(config)))}")


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Rank `rank` of `size`: the ranges of heads, KV heads, MLP rows and vocabulary it holds."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]  # the rows it holds; rows past vocab_size are zero padding
    vocab_size: int

    @property
    def vocab_shard(self) -> int:
        return self.vocab[1] - self.vocab[0]


def shard_layout(config: ModelConfig, rank: int, size: int) -> ShardLayout:
    check_degree(config, size)
    h, kvh = config.num_heads // size, config.num_kv_heads
    if kvh >= size:
        per = kvh // size
        kv = (rank * per, (rank + 1) * per)
    else:  # fewer KV heads than ranks: rank r's query heads all read KV head r // (size / kvh)
        k = rank // (size // kvh)
        kv = (k, k + 1)
    inter = config.intermediate_size // size
    vs = -(-config.vocab_size // size)
    return ShardLayout(rank, size, (rank * h, (rank + 1) * h), kv, (rank * inter, (rank + 1) * inter),
                       (rank * vs, (rank + 1) * vs), config.vocab_size)


def kv_head_owners(config: ModelConfig, size: int) -> list[int]:
    """For each KV head, the first rank holding it (where a canonical block's heads come from)."""
    owners: dict[int, int] = {}
    for r in range(size):
        k0, k1 = shard_layout(config, r, size).kv_heads
        for k in range(k0, k1):
            owners.setdefault(k, r)
    return [owners[k] for k in range(config.num_kv_heads)]


def shard_config(config: ModelConfig, layout: ShardLayout) -> ModelConfig:
    """The shape of one rank's slice of the model (what its LlamaModel is built with)."""
    return dataclasses.replace(config, num_heads=layout.heads[1] - layout.heads[0],
                               num_kv_heads=layout.kv_heads[1] - layout.kv_heads[0],
                               intermediate_size=layout.mlp[1] - layout.mlp[0])


def shard_weights(config: ModelConfig, weights: dict, layout: ShardLayout) -> dict:
    """Rank `layout.rank`'s weights (HF names, as LlamaModel takes them): copies, so that the
    full checkpoint can be freed."""
    arch, hd = config.arch, config.head_dim
    q = (layout.heads[0] * hd, layout.heads[1] * hd)
    kv = (layout.kv_heads[0] * hd, layout.kv_heads[1] * hd)
    out_rows = {"q": q, "q_bias": q, "k": kv, "k_bias": kv, "v": kv, "v_bias": kv,
                "gate": layout.mlp, "up": layout.mlp}
    in_cols = {"o": q, "down": layout.mlp}
    out: dict = {}
    for i in range(config.num_layers):
        for t in arch.layer_tensors:
            name = arch.layer_name(i, t.role)
            if name not in weights:
                continue
            w = weights[name]
            if t.role in out_rows:
                out[name] = split_rows(w, *out_rows[t.role], name)
            elif t.role in in_cols:
                out[name] = split_cols(w, *in_cols[t.role], name)
            else:
                out[name] = w  # norms: replicated
    embed, head = arch.global_name("embed"), arch.global_name("lm_head")
    out[embed] = vocab_rows(weights[embed], layout)
    out[head] = out[embed] if weights.get(head, weights[embed]) is weights[embed] else vocab_rows(weights[head], layout)
    out[arch.global_name("final_norm")] = weights[arch.global_name("final_norm")]
    return out


def vocab_rows(w: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Rows `layout.vocab` of a [V, D] matrix, zero-padded past V."""
    a, b = layout.vocab
    shard = torch.zeros((b - a, w.shape[1]), dtype=w.dtype, device=w.device)
    end = min(b, w.shape[0])
    if end > a:
        shard[:end - a] = w[a:end]
    return shard


def split_rows(w, a: int, b: int, name: str):
    """Output rows [a, b) of a weight [out, in] (or a bias [out])."""
    if isinstance(w, torch.Tensor):
        return w[a:b].clone()
    if isinstance(w, QuantizedWeight):
        zeros = unpack_cols(w.qzeros, w.bits, w.out_features)[:, a:b]  # [groups, b - a]
        return dataclasses.replace(w, qweight=w.qweight[:, a:b].clone(), qzeros=pack_cols(zeros, w.bits),
                                   scales=w.scales[:, a:b].clone(), out_features=b - a)
    raise _unsplittable(w, name)


def split_cols(w, a: int, b: int, name: str):
    """Input columns [a, b) of a weight [out, in]."""
    if isinstance(w, torch.Tensor):
        return w[:, a:b].clone()
    if isinstance(w, QuantizedWeight):
        p = per_word(w.bits)
        if a % p or (b % p and b != w.in_features):
            raise ShardingError(f"{name}: its {w.bits}-bit codes pack {p} inputs per word, and the split at "
                                f"inputs {a}..{b} cuts a word: pick a --tensor-parallel-size that splits "
                                f"on multiples of {p}")
        g = w.g_idx[a:b].long()  # the groups these inputs use (a range; all of them under act-order)
        g0, g1 = int(g.min()), int(g.max()) + 1
        return dataclasses.replace(w, qweight=w.qweight[a // p:-(-b // p)].clone(), qzeros=w.qzeros[g0:g1].clone(),
                                   scales=w.scales[g0:g1].clone(), g_idx=(g - g0).to(w.g_idx.dtype),
                                   in_features=b - a)
    raise _unsplittable(w, name)


def _unsplittable(w, name: str) -> ShardingError:
    return ShardingError(f"{name}: tensor parallelism splits dense and GPTQ weights, not {type(w).__name__} "
                         f"(--weight-format int4, W8A8): serve it with --weight-format dense or one rank")
