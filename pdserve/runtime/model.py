"""Our own forward pass of the Llama family (Llama, Mistral, Qwen2), with one decoder layer.

`DecoderLayer` is the only implementation of a layer. Its attention is passed in: serving runs it
over the paged KV cache (`PagedAttention`, from `LlamaModel.forward`), GPTQ calibration over dense
batches of whole sequences (`CausalAttention`, from `dense_forward`); norms, projections, RoPE and
the MLP are the same code in both. Weights come in HF naming, looked up through the architecture
spec (`config.arch`, see `runtime.arch`); q/k/v and gate/up are fused into one matrix each so that
one step is few large matmuls. Projections are "linear" objects (`pdserve.quant.linear`): dense ones
run F.linear, GPTQ-quantized ones dequantize on the fly. The math follows transformers'
LlamaForCausalLM (rotate-half RoPE, fp32 RMSNorm), which the tests hold it to.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from pdserve.quant.int4_cpu import token_kinds_of
from pdserve.quant.linear import Linear, as_linear, fused_linear, keep_dense_copy
from pdserve.runtime.arch import LinearSite
from pdserve.runtime.attention import AttentionMetadata, OutputRows, RowSplit, split_generated_decodes
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.kernels import get_kernels, torch_ops
from pdserve.runtime.kernels.cpu_decode_step import DecodeStepPlan

# (layer index, q [N, H, hd], k [N, KVH, hd], v [N, KVH, hd]) -> attention output [N, H, hd].
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Sums a row-parallel projection's partial output [N, D] over the tensor-parallel ranks (in place
# or not); None on one rank. The only thing tensor parallelism changes inside a layer
# (pdserve.runtime.parallel).
AllReduce = Callable[[torch.Tensor], torch.Tensor]
_UNPLANNED = object()  # LlamaModel._decode_step before its first forward


@dataclass(frozen=True, slots=True)
class LayerContext:
    """What every layer of a model shares: the kernels, shape constants and RoPE tables."""

    kernels: ModuleType
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    split: tuple[int, int, int]  # widths of q, k, v in the fused qkv output
    cos: torch.Tensor  # [max_positions, hd]
    sin: torch.Tensor  # [max_positions, hd]
    all_reduce: AllReduce | None = None  # after o and down, when the layer is one rank's shard

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)


def layer_context(config: ModelConfig, kernels: ModuleType, device: str | torch.device = "cpu",
                  all_reduce: AllReduce | None = None) -> LayerContext:
    """The shared part of `config`'s layers, RoPE tables on `device`. A tensor-parallel rank passes
    its shard's config (its heads, its part of the MLP) and the group's `all_reduce`."""
    cos, sin = torch_ops.rope_cos_sin(config.head_dim, config.max_position_embeddings, config.rope_theta)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return LayerContext(kernels, config.rms_norm_eps, config.num_heads, config.num_kv_heads, config.head_dim,
                        (q, kv, kv), cos.to(device), sin.to(device), all_reduce)


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    """One pre-norm decoder layer over N tokens in a flat batch; the attention is an argument."""

    index: int  # its layer in the KV cache
    input_norm: torch.Tensor  # [D]
    qkv: Linear  # [N, D] -> [N, (H + 2 * KVH) * hd], bias included
    o: Linear  # [N, H * hd] -> [N, D]
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # [N, D] -> [N, 2 * I]
    down: Linear  # [N, I] -> [N, D]
    ctx: LayerContext

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                 attend: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, D], the previous layer's MLP output (layer 0: the embeddings, residual None);
        residual: [N, D], the residual stream before it. Returns this layer's (MLP output, residual
        stream before it): their sum is the layer's output, left unsummed so that the next layer's
        norm (or the final one) fuses the add. positions: [N] RoPE positions."""
        return self.mlp(*self.attention(hidden, residual, positions, attend))

    def attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  attend: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention output: (attention output [N, H * hd] (or the rows `attend`
        returns), residual stream [N, D] entering the layer); arguments as `__call__`'s."""
        c = self.ctx
        k = c.kernels
        if residual is None:
            residual = hidden
            hidden = k.rms_norm(hidden, self.input_norm, c.eps)
        else:
            hidden, residual = k.add_rms_norm(hidden, residual, self.input_norm, c.eps)
        n = hidden.shape[0]
        q, key, value = self.qkv(hidden).split(c.split, dim=-1)  # [N, H * hd], [N, KVH * hd] x 2
        q = q.view(n, c.num_heads, c.head_dim)
        key = key.view(n, c.num_kv_heads, c.head_dim)
        value = value.view(n, c.num_kv_heads, c.head_dim)
        q, key = k.apply_rope(q, key, positions, c.cos, c.sin)
        out = attend(self.index, q, key, value)  # [N, H, hd]
        return out.view(out.shape[0], c.num_heads * c.head_dim), residual

    def mlp(self, attention_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer: attention output [R, H * hd] and the residual stream [R, D] of the same
        rows -> (MLP output, residual stream before it), as `__call__` returns them."""
        c = self.ctx
        k = c.kernels
        hidden, residual = k.add_rms_norm(c.reduce(self.o(attention_out)), residual, self.post_norm, c.eps)
        return c.reduce(self.down(k.silu_and_mul(self.gate_up(hidden)))), residual


def site_linear(config: ModelConfig, w: dict, i: int, site: LinearSite) -> Linear:
    """Layer i's linear of `site`: its weights (tensors or QuantizedWeights) fused, biases included."""
    arch = config.arch
    weights = [w[arch.layer_name(i, r)] for r in site.weights]
    has_bias = bool(site.biases) and arch.layer_tensor(site.biases[0]).present(config)
    biases = [w[arch.layer_name(i, r)] for r in site.biases] if has_bias else None
    if len(weights) == 1:
        return as_linear(weights[0], biases[0] if biases else None)
    return fused_linear(weights, biases)


def build_layer(config: ModelConfig, w: dict, i: int, ctx: LayerContext) -> DecoderLayer:
    """Layer i of a weight dict keyed by HF names."""
    arch = config.arch
    if arch.qk_norm:  # a spec with it needs q_norm/k_norm here and their branch in DecoderLayer
        raise NotImplementedError(f"{arch.name}: QK-norm is not implemented")
    linears = {site.name: site_linear(config, w, i, site) for site in arch.sites}
    return DecoderLayer(index=i, input_norm=w[arch.layer_name(i, "input_norm")],
                        post_norm=w[arch.layer_name(i, "post_norm")], ctx=ctx, **linears)


class PagedAttention:
    """Serving's attention: writes the step's K/V into the paged cache, then attends over it
    (decode tokens first, one per sequence, then each prefill chunk; see `attention`)."""

    __slots__ = ("kernels", "meta", "kv_cache", "scale")

    def __init__(self, kernels: ModuleType, meta: AttentionMetadata, kv_cache: torch.Tensor, scale: float) -> None:
        self.kernels, self.meta, self.kv_cache, self.scale = kernels, meta, kv_cache, scale

    def __call__(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """q [N, H, hd], key and value [N, KVH, hd] -> [N, H, hd]."""
        k, meta, cache = self.kernels, self.meta, self.kv_cache
        k.write_kv(cache, layer, key, value, meta.slot_mapping)
        out = torch.empty_like(q)  # [N, H, hd]
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decodes(layer, q)
        for p in meta.prefills:
            sl = slice(p.query_start, p.query_start + p.query_len)
            out[sl] = k.prefill_attention(q[sl], cache, layer, p.block_table, p.context_len, self.scale)
        return out

    def kept_rows(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kept: OutputRows) -> torch.Tensor:
        """As a call, every row's K/V written, but -> [R, H, hd]: the output of `kept`'s rows only, the
        decode rows and each chunk's last tails[i] rows (which attend as the last rows of their context,
        each on its own: the values the whole chunk's call gives them)."""
        k, meta, cache = self.kernels, self.meta, self.kv_cache
        k.write_kv(cache, layer, key, value, meta.slot_mapping)
        parts = [self._decodes(layer, q)] if meta.num_decode_tokens else [q[:0]]
        for p, rows in zip(meta.prefills, kept.tails):
            if rows:
                end = p.query_start + p.query_len
                parts.append(k.prefill_attention(q[end - rows:end], cache, layer, p.block_table, p.context_len,
                                                 self.scale))
        return torch.cat(parts)

    def _decodes(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        nd = meta.num_decode_tokens
        return self.kernels.paged_decode_attention(q[:nd], self.kv_cache, layer, meta.decode_block_tables,
                                                   meta.decode_context_lens, self.scale)

    def keeping(self, kept: OutputRows) -> Attention:
        """This attention computing the output of `kept`'s rows only (every row's K/V still written)."""
        return lambda layer, q, key, value: self.kept_rows(layer, q, key, value, kept)


class CausalAttention:
    """Calibration's attention: `batch` whole sequences of `seq_len` tokens each (rows sequence
    by sequence), causal, no cache."""

    __slots__ = ("batch", "seq_len", "scale")

    def __init__(self, batch: int, seq_len: int, scale: float) -> None:
        self.batch, self.seq_len, self.scale = batch, seq_len, scale

    def __call__(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        b, t, (h, d), kvh = self.batch, self.seq_len, q.shape[1:], key.shape[1]
        out = F.scaled_dot_product_attention(
            q.view(b, t, h, d).transpose(1, 2), key.view(b, t, kvh, d).transpose(1, 2),
            value.reshape(b, t, kvh, d).transpose(1, 2), is_causal=True, scale=self.scale,
            enable_gqa=True)  # [B, H, T, hd]
        return out.transpose(1, 2).reshape(b * t, h, d)


def dense_forward(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D], hidden states of B whole sequences entering the layer -> [B, T, D] leaving it."""
    b, t, d = x.shape
    attend = CausalAttention(b, t, 1.0 / math.sqrt(layer.ctx.head_dim))
    hidden, residual = layer(x.reshape(b * t, d), None, torch.arange(t, device=x.device).repeat(b), attend)
    return (hidden + residual).view(b, t, d)


class LlamaModel:
    """Stateless forward: the KV cache and the step's metadata are passed in."""

    def __init__(self, config: ModelConfig, weights: dict, device: str = "cpu",
                 all_reduce: AllReduce | None = None, step_threads: int = 0) -> None:
        """weights: HF names -> tensors, or `QuantizedWeight`s for quantized projections. A
        tensor-parallel rank (pdserve.runtime.parallel) passes its shard's config and weights and
        the group's `all_reduce`. step_threads: the one-call C decode step's (0: torch's count)."""
        self.config = config
        self.kernels = get_kernels(device)
        arch = config.arch
        w = {name: t.to(device) for name, t in weights.items()}
        self.embed = w[arch.global_name("embed")]  # [V, D]
        self.lm_head = w.get(arch.global_name("lm_head"), self.embed)  # [V, D]
        self.final_norm = w[arch.global_name("final_norm")]  # [D]
        ctx = layer_context(config, self.kernels, device, all_reduce)
        self.layers = [build_layer(config, w, i, ctx) for i in range(config.num_layers)]
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.step_threads = step_threads
        # Called on the engine thread after each layer of an eager step (runtime.core_share: a worker
        # gives a core back to a worker of the other kind that started computing); None: nothing.
        self.between_layers: Callable[[], None] | None = None
        self._decode_step: DecodeStepPlan | None | object = _UNPLANNED

    def keep_dense_copies(self, int8_prompts: bool = False) -> None:
        """Packed projections keep their dequantized weights for prefill chunks (quant.linear.keep_dense_copy;
        `int8_prompts`: every row on the int8-input kernels instead where they run, no copy kept)."""
        for layer in self.layers:
            for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
                keep_dense_copy(linear, int8_prompts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [N] -> final hidden states [N, D]; writes the step's KV. output_rows:
        [R] int64 ascending, the rows the caller uses (those that sample): then returns those [R, D],
        the same values, and a prefill step leaves the other rows out of its last layer (`OutputRows`)."""
        hidden = self.embed_tokens(input_ids)  # [N, D]
        step = self.one_call_decode_step()
        if step is not None and step.applies(hidden, meta, kv_cache):
            out = step.run(hidden, positions, meta, kv_cache)  # the same bits as the layers below
            return out if output_rows is None else out[output_rows]
        split = split_generated_decodes(meta) if step is not None else None
        if split is not None:
            decode_hidden = hidden[split.decode_rows]  # [G, D]
            if step.applies(decode_hidden, split.decode, kv_cache):
                return self._split_forward(step, hidden, decode_hidden, positions, split, kv_cache, output_rows)
        return self._rows_forward(hidden, positions, meta, kv_cache, output_rows)

    def _rows_forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_cache: torch.Tensor, output_rows: torch.Tensor | None) -> torch.Tensor:
        """`_layers_forward`'s final hidden states of `output_rows` (every row where None), the other rows
        left out of the last layer where `_kept_rows` allows it."""
        kept = self._kept_rows(meta, output_rows)
        out = self._layers_forward(hidden, positions, meta, kv_cache, kept)
        return out if output_rows is None or kept is not None else out[output_rows]

    def _kept_rows(self, meta: AttentionMetadata, output_rows: torch.Tensor | None) -> OutputRows | None:
        """`output_rows` as the rows the last layer computes past its K/V, where that leaves every kept
        row's bits as the whole layer gives them: its projections split rows by token kind (prompt rows on
        a row-invariant GEMM, `rows_split_by_kind`; a kernel chosen by row count would take other sums for
        a lone row) and every generated row is kept (they stay one group of the same size). Else None."""
        generated = meta.generated_rows
        if output_rows is None or generated is None:
            return None
        last = self.layers[-1]
        if not all(getattr(linear, "rows_split_by_kind", False) for linear in (last.o, last.gate_up, last.down)):
            return None
        kept = OutputRows.of(meta, output_rows)
        if kept is None or int(generated[kept.rows].sum()) != int(generated.sum()):
            return None
        return kept

    def _split_forward(self, step: DecodeStepPlan, hidden: torch.Tensor, decode_hidden: torch.Tensor,
                       positions: torch.Tensor, split: RowSplit, kv_cache: torch.Tensor,
                       output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, D] (decode_hidden: its rows split.decode_rows) -> [N, D] (of `output_rows`: [R, D]): the
        generated decode rows in the C step, the others layer by layer (`_rows_forward`).

        Why: a step that admits a prompt (or, on a decode worker, a request's last prompt token) would
        otherwise run its decode rows eagerly too: bench-engine's mixed steps (31 decodes and a short
        prompt) took 285 ms against 110 for 32 decodes. Rows do not interact outside attention, which
        reads each sequence's own KV, and each kind of row takes the same functions either way (the
        generated rows' projections the same kernel, the prompt rows' the row-invariant dense GEMM),
        so the bits are those of the step run whole."""
        d, r = split.decode_rows, split.rest_rows  # ascending, together every row
        decoded = step.run(decode_hidden, positions[d], split.decode, kv_cache)  # [G, D]
        if output_rows is None:
            out = torch.empty_like(hidden)
            out[d] = decoded
            out[r] = self._rows_forward(hidden[r], positions[r], split.rest, kv_cache, None)
            return out
        in_rest = torch.isin(output_rows, r)  # [R] bool
        out = hidden.new_empty((output_rows.numel(), hidden.shape[1]))
        out[~in_rest] = decoded[torch.searchsorted(d, output_rows[~in_rest])]
        out[in_rest] = self._rows_forward(hidden[r], positions[r], split.rest, kv_cache,
                                          torch.searchsorted(r, output_rows[in_rest]))
        return out

    def _layers_forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_cache: torch.Tensor, kept: OutputRows | None = None) -> torch.Tensor:
        """hidden: [N, D] embeddings -> final hidden states [N, D] (with `kept`: of its rows, [R, D]), layer
        by layer; writes the step's KV."""
        attend = PagedAttention(self.kernels, meta, kv_cache, self.scale)
        residual = None
        with token_kinds_of(meta.generated_rows):  # int4: each token kind on its kernel
            for i, layer in enumerate(self.layers):
                if kept is not None and i == len(self.layers) - 1:
                    hidden, residual = self._last_layer_kept(layer, hidden, residual, positions, attend, kept)
                else:
                    hidden, residual = layer(hidden, residual, positions, attend)
                if self.between_layers is not None:
                    self.between_layers()
        hidden, _ = self.kernels.add_rms_norm(hidden, residual, self.final_norm, self.config.rms_norm_eps)
        return hidden

    @staticmethod
    def _last_layer_kept(layer: DecoderLayer, hidden: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, attend: PagedAttention, kept: OutputRows
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer with every row's K/V written but the rest computed for the kept rows only: their
        attention output, o projection and MLP (each row's own, so the same values as the whole layer's;
        their token kinds told again for the int4 projections, which split a call's rows by kind)."""
        out, residual = layer.attention(hidden, residual, positions, attend.keeping(kept))  # [R, H * hd], [N, D]
        rows = kept.rows
        if not len(rows):  # a chunk that samples nothing: its K/V was all the step needed
            return residual[:0], residual[:0]
        generated = attend.meta.generated_rows
        with token_kinds_of(None if generated is None else generated[rows]):
            return layer.mlp(out, residual[rows])

    def one_call_decode_step(self) -> DecodeStepPlan | None:
        """The C decode step of this model (kernels.cpu_decode_step), planned at its first forward (after
        the engine has packed its weights); None where it does not cover the model."""
        if self._decode_step is _UNPLANNED:
            self._decode_step = DecodeStepPlan.of(self) if self.kernels is torch_ops else None
        return self._decode_step

    def run_decode_steps_eagerly(self) -> None:
        """Layer by layer from Python from now on, never the one-call C step (a benchmark's baseline)."""
        self._decode_step = None

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [N] -> embeddings [N, D] (a vocabulary-parallel rank overrides it)."""
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(input_ids, self.embed)
        return self.embed.embedding(input_ids)  # 8-bit codes (pdserve.quant.q8_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, D] -> logits [S, V] in fp32."""
        if isinstance(self.lm_head, torch.Tensor):
            return F.linear(hidden, self.lm_head).float()
        return self.lm_head(hidden)  # 8-bit codes (pdserve.quant.q8_head)
