"""Quantization-aware training (QAT) by distillation from the FP32 model, exported as a GPTQ checkpoint.

The path of one run, with the data at each hop:

    prompts (data/qat_prompts_*.txt)  --generate_rows-->  [n, T] token rows the FP32 model wrote
    rows, FP32 weights  --train-->  latent fp32 projection weights (the student's parameters)
    latent weights  --export_weights-->  QuantizedWeights (RTN of the latent weights = the fake
                                         quantization of the last step, bit for bit)
    QuantizedWeights  --checkpoint.save_quantized-->  the directory `pdserve quantize` writes

The student is our own runtime's forward (`runtime.model.DecoderLayer` over whole sequences, as GPTQ
calibration runs it: `dense_forward`), every decoder projection replaced by a `FakeQuantLinear`;
embeddings, norms and lm_head stay FP32 and frozen. The forward quantizes each projection exactly as
the export will (`quantizer.group_params`: per-group asymmetric INT4 / per-channel INT8, fp16-rounded
scales, zero >= 1) with the scales recomputed from the current weights at every step; the backward is
the straight-through estimator (the identity: min/max scales leave every weight inside the grid). The loss
is KL(teacher || student) of next-token distributions at temperature 1, optionally plus
cross-entropy on the text's own next tokens.

Why recomputed (min/max) scales and not learned ones: export is then plain RTN of the trained
weights, the very rule the forward applied, so the checkpoint holds the trained model exactly and
needs nothing beyond what `pdserve quantize --method rtn` writes; the weights themselves learn
where to sit inside the grid, which is where most of QAT's gain is (a learned scale would add a
parameter per group and its own rounding to fp16 at export).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.quant.calibration import has_chat_template
from pdserve.quant.gptq_format import QuantizedWeight
from pdserve.quant.quantizer import group_params, rtn_quantize
from pdserve.quant.spec import QuantError, QuantSpec
from pdserve.runtime.config import ModelConfig
from pdserve.runtime.kernels import torch_ops
from pdserve.runtime.model import DecoderLayer, build_layer, dense_forward, layer_context

DATA_DIR = Path(__file__).resolve().parent / "data"
# Prompt sets the FP32 teacher continues to make the training text. Disjoint from every held-out set:
# quant-eval's PROMPTS, stories260k_eval.jsonl (BOS, seeds 2000..), qat_eval_prompts_chat.txt.
PROMPT_SETS = {
    "stories": DATA_DIR / "qat_prompts_stories.txt",  # 64 TinyStories-style openings
    "chat": DATA_DIR / "qat_prompts_chat.txt",  # 64 questions, sent through the chat template
}
EVAL_PROMPTS_CHAT = DATA_DIR / "qat_eval_prompts_chat.txt"  # 12 held-out questions (measurements)
TRAIN_SEED = 3000  # request i of the training text is sampled with seed TRAIN_SEED + i

Progress = Callable[[int, float], None]  # (step done, its loss)


@dataclass(frozen=True, slots=True)
class QATConfig:
    """One QAT run: the target format, the optimiser and the data it sees."""

    spec: QuantSpec  # the format trained for and exported (desc_act is not supported: groups are consecutive)
    steps: int = 100  # optimiser steps
    lr: float | None = None  # Adam's learning rate, cosine-decayed to a tenth (None: `default_lr` of the model)
    seq_len: int = 128  # tokens per training row
    batch: int = 4  # rows per step
    seed: int = 0  # row order
    ce_weight: float = 0.0  # weight of the cross-entropy on the text beside the KL (0: pure distillation)
    gen_tokens: int = 256  # tokens the teacher writes per prompt
    prompts: str = "auto"  # a PROMPT_SETS name, a file (one prompt per line), or auto (chat if the tokenizer has a template)

    def __post_init__(self) -> None:
        checks = ((self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
                  (self.lr is None or (self.lr > 0 and math.isfinite(self.lr)), f"--lr must be a positive number, got {self.lr}"),
                  (self.seq_len >= 2, f"--seq-len must be at least 2, got {self.seq_len}"),
                  (self.batch >= 1, f"--batch must be at least 1, got {self.batch}"),
                  (self.ce_weight >= 0, f"--ce-weight must be >= 0, got {self.ce_weight}"),
                  (self.gen_tokens >= 1, f"--gen-tokens must be at least 1, got {self.gen_tokens}"),
                  (not self.spec.desc_act, "QAT quantizes consecutive groups: activation order (desc_act) is GPTQ's"),
                  (self.prompts == "auto" or self.prompts in PROMPT_SETS or Path(self.prompts).expanduser().is_file(),
                   f"--calibration {self.prompts!r}: no such prompt set ({', '.join(PROMPT_SETS)}, auto) or file"))
        for ok, message in checks:
            if not ok:
                raise QuantError(message)


# ---- the fake-quantization op ---------------------------------------------------------------------

def group_view(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w: [out, in] -> [out * groups, g], the last group padded with zeros.

    Zero padding leaves every group's parameters unchanged: the asymmetric range always includes 0
    and the symmetric one is a max of |w|, so `group_params` of the padded rows equals its value on
    the real columns (what `rtn_quantize` computes group by group)."""
    out, n = w.shape
    g = spec.group_len(n)
    groups = spec.groups(n)
    padded = F.pad(w, (0, groups * g - n)) if groups * g != n else w
    return padded.reshape(out * groups, g)


def fake_quant(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The export's RTN of w [out, in], dequantized: [out, in] float32, no gradient.

    Every weight lies inside its group's grid (the range is the group's own min/max, or max |w|);
    at most a group's extreme weight lands one step past the last code when both roundings go up,
    and is clamped. The straight-through estimator below passes the gradient to every weight."""
    out, n = w.shape
    with torch.no_grad():
        rows = group_view(w.float(), spec)  # [out * G, g]
        scale, zero = group_params(rows, spec)  # [out * G] each
        scale, zero = scale[:, None], zero[:, None].float()
        # quantize_codes then (codes - zero) * scale, in place in fp32: every intermediate is an
        # integer below 2**24, so this is bit for bit QuantizedWeight.dequantize of the export, in
        # a third of the memory passes (this runs on every projection at every step).
        wq = torch.div(rows, scale).round_().add_(zero).clamp_(0, spec.maxq).sub_(zero).mul_(scale)
    return wq.reshape(out, -1)[:, :n]


class FakeQuantize(torch.autograd.Function):
    """Forward: w's round-to-nearest quantization, dequantized; backward: the straight-through
    estimator, dL/dw = dL/dw_q (rounding's true derivative is zero almost everywhere)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:  # type: ignore[override]
        return fake_quant(w, spec).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w: [out, in] -> [out, in], quantized then dequantized, differentiable by the STE."""
    return FakeQuantize.apply(w, spec)


class FakeQuantLinear:
    """A site's projections (q|k|v, gate|up, o, down) as trainable fp32 weights, fake-quantized on
    each call; the same interface as the runtime's linears (`quant.linear.Linear`)."""

    def __init__(self, weights: Sequence[torch.Tensor], spec: QuantSpec, bias: torch.Tensor | None = None) -> None:
        self.weights = list(weights)  # [out_j, in] leaf tensors with requires_grad
        self.spec, self.bias = spec, bias
        self.out_features = sum(w.shape[0] for w in weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Each projection is quantized on its own (per-row groups: the same as quantizing the concatenation).
        w = torch.cat([fake_quantize(p, self.spec) for p in self.weights])  # [out, in]
        return F.linear(x, w, self.bias)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)


# ---- the model: our layers over whole sequences ----------------------------------------------------

@dataclass(frozen=True)
class Student:
    """The FP32 model with every decoder projection a FakeQuantLinear over `params` (HF names)."""

    config: ModelConfig
    globals_: dict[str, torch.Tensor]  # embed, final norm, lm_head: frozen fp32
    layers: list[DecoderLayer]
    params: dict[str, torch.Tensor]  # projection name -> trainable [out, in], what the optimiser updates


def projection_names(config: ModelConfig) -> list[str]:
    return config.arch.projection_names(config)


def build_student(config: ModelConfig, weights: dict, spec: QuantSpec) -> Student:
    arch, ctx = config.arch, layer_context(config, torch_ops)
    params = {n: weights[n].detach().float().clone().requires_grad_(True) for n in projection_names(config)}
    layers = []
    for i in range(config.num_layers):
        lw = {n: weights[n].float() for n in arch.layer_names(config, i)}
        layer = build_layer(config, lw, i, ctx)
        fake = {}
        for site in arch.sites:
            has_bias = bool(site.biases) and arch.layer_tensor(site.biases[0]).present(config)
            bias = torch.cat([lw[arch.layer_name(i, r)] for r in site.biases]) if has_bias else None
            fake[site.name] = FakeQuantLinear([params[arch.layer_name(i, r)] for r in site.weights], spec, bias)
        layers.append(replace(layer, **fake))
    return Student(config, _global_weights(config, weights), layers, params)


def _global_weights(config: ModelConfig, weights: dict) -> dict[str, torch.Tensor]:
    arch = config.arch
    embed = weights[arch.global_name("embed")].float()
    return {"embed": embed, "final_norm": weights[arch.global_name("final_norm")].float(),
            "lm_head": weights.get(arch.global_name("lm_head"), embed).float()}


def forward_logits(config: ModelConfig, globals_: dict[str, torch.Tensor], layers: list[DecoderLayer],
                   ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, T] whole sequences -> logits [B, T, V] (fp32), causal attention, no cache."""
    x = F.embedding(ids, globals_["embed"])  # [B, T, D]
    for layer in layers:
        x = dense_forward(layer, x)
    h = torch_ops.rms_norm(x, globals_["final_norm"], config.rms_norm_eps)
    return F.linear(h, globals_["lm_head"]).float()


def distillation_loss(student_logits: torch.Tensor, teacher_logp: torch.Tensor, ids: torch.Tensor,
                      ce_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, KL) with KL(teacher || student) at temperature 1, averaged over the B * T positions.

    student_logits: [B, T, V]; teacher_logp: [B, T, V] log-probabilities; ids: [B, T] (the CE term
    predicts ids[:, 1:] from positions :-1)."""
    v = student_logits.shape[-1]
    logp = F.log_softmax(student_logits, dim=-1).reshape(-1, v)
    kl = F.kl_div(logp, teacher_logp.reshape(-1, v), log_target=True, reduction="batchmean")
    if not ce_weight:
        return kl, kl.detach()
    ce = F.cross_entropy(student_logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))
    return kl + ce_weight * ce, kl.detach()


# ---- data: text the FP32 model writes ---------------------------------------------------------------

def load_prompts(source: str, tokenizer) -> tuple[str, list[str]]:
    """(set name, prompts) for a PROMPT_SETS name, a file with one prompt per line, or "auto"."""
    if source == "auto":
        source = "chat" if has_chat_template(tokenizer) else "stories"
    path = PROMPT_SETS.get(source) or Path(source).expanduser()
    if not path.is_file():
        raise QuantError(f"--calibration {source!r}: no such prompt set ({', '.join(PROMPT_SETS)}, auto) or file")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise QuantError(f"--calibration {path}: no prompts (one per line)")
    return source, prompts


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    return tokenizer.encode(prompt, add_bos=True)


def generate(checkpoint, prompts: list[list[int]], seed: int, max_tokens: int,
             temperature: float = 1.0) -> list[list[int]]:
    """Each prompt followed by what the FP32 model writes after it (request i seeded seed + i)."""
    from pdserve.runtime.config import CacheConfig, EngineConfig
    from pdserve.runtime.engine import Engine
    from pdserve.runtime.sampling_params import SamplingParams

    block, longest = 16, max(len(p) for p in prompts) + max_tokens
    blocks = 32 * -(-longest // block) + 8  # room for the 32 sequences a step runs at most
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(block_size=block, num_blocks=blocks),
                                                             weight_format="dense"))
    seqs = [engine.add_request(f"qat-{seed + i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                     seed=seed + i))
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [list(p) + list(s.output_ids) for p, s in zip(prompts, seqs)]


def chunk_rows(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """The sequences concatenated and cut into [n, seq_len] rows (the tail dropped): every row is
    full, and teacher and student see the same context, so a boundary inside a row does no harm."""
    stream = [t for s in sequences for t in s]
    n = len(stream) // seq_len
    if n == 0:
        raise QuantError(f"the training text has {len(stream)} tokens, fewer than one row of --seq-len {seq_len}")
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).view(n, seq_len)


def check_fits(cfg: QATConfig, config: ModelConfig) -> None:
    if cfg.seq_len > config.max_position_embeddings:
        raise QuantError(f"--seq-len {cfg.seq_len} exceeds the model's context of {config.max_position_embeddings}")


def generate_rows(checkpoint, cfg: QATConfig) -> tuple[torch.Tensor, dict[str, Any]]:
    """Training rows [n, seq_len] and their provenance."""
    check_fits(cfg, checkpoint.config)
    name, prompts = load_prompts(cfg.prompts, checkpoint.tokenizer)
    chat = name == "chat" or (name not in PROMPT_SETS and has_chat_template(checkpoint.tokenizer))
    ids = [prompt_ids(checkpoint.tokenizer, p, chat) for p in prompts]
    rows = chunk_rows(generate(checkpoint, ids, TRAIN_SEED, cfg.gen_tokens), cfg.seq_len)
    return rows, {"prompts": name, "num_prompts": len(prompts), "chat_template": chat, "seed": TRAIN_SEED,
                  "gen_tokens": cfg.gen_tokens, "temperature": 1.0, "rows": int(rows.shape[0]), "seq_len": cfg.seq_len}


# ---- training ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QATResult:
    """What a run made: the export, the trained latent weights, and how training went."""

    weights: dict  # the checkpoint's weight dict with QuantizedWeights: loads into Engine like quantize_model's
    latent: dict[str, torch.Tensor]  # projection name -> trained fp32 weight before quantization
    losses: list[float]  # KL per step
    wall_s: float
    data: dict[str, Any]  # provenance of the training text
    config: QATConfig  # the run's configuration, learning rate resolved

    @property
    def lr(self) -> float:
        return self.config.lr


def teacher_log_probs(config: ModelConfig, weights: dict, rows: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """The FP32 model's log-probabilities of every row, computed once when they fit in 512 MB
    (stories260K), else None entries (computed per step: SmolLM2's 49K vocabulary)."""
    v = config.vocab_size
    if rows.numel() * v * 4 > 512 << 20:
        return [None] * len(rows)
    layers = build_layers(config, weights)
    globals_ = _global_weights(config, weights)
    out = []
    with torch.no_grad():
        for j in range(0, len(rows), batch):
            out += list(F.log_softmax(forward_logits(config, globals_, layers, rows[j:j + batch]), dim=-1))
    return out


def build_layers(config: ModelConfig, weights: dict) -> list[DecoderLayer]:
    """The runtime's layers of a weight dict (fp32 tensors or QuantizedWeights)."""
    ctx = layer_context(config, torch_ops)
    return [build_layer(config, weights, i, ctx) for i in range(config.num_layers)]


def train(config: ModelConfig, weights: dict, rows: torch.Tensor, cfg: QATConfig,
          progress: Progress | None = None) -> tuple[Student, list[float]]:
    """Runs cfg.steps Adam steps on the student; returns it and the KL of each step."""
    student = build_student(config, weights, cfg.spec)
    teacher_layers, teacher_globals = build_layers(config, weights), _global_weights(config, weights)
    cached = teacher_log_probs(config, weights, rows, cfg.batch)
    opt = torch.optim.Adam(list(student.params.values()), lr=cfg.lr, fused=True)  # one pass per tensor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * s / cfg.steps)))
    order = _row_order(len(rows), cfg.steps * cfg.batch, cfg.seed)
    losses = []
    for step in range(cfg.steps):
        idx = order[step * cfg.batch:(step + 1) * cfg.batch]
        ids = rows[idx]  # [B, T]
        if cached[int(idx[0])] is not None:
            teacher = torch.stack([cached[int(i)] for i in idx])
        else:
            with torch.no_grad():  # not inference_mode: the KL saves the target for its backward
                teacher = F.log_softmax(forward_logits(config, teacher_globals, teacher_layers, ids), dim=-1)
        loss, kl = distillation_loss(forward_logits(config, student.globals_, student.layers, ids), teacher,
                                     ids, cfg.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(kl.item())
        if progress:
            progress(step + 1, losses[-1])
    return student, losses


def _row_order(num_rows: int, needed: int, seed: int) -> torch.Tensor:
    """Row indices for `needed` draws: shuffled epochs over the rows, seeded."""
    g = torch.Generator().manual_seed(seed)
    epochs = -(-needed // num_rows)
    return torch.cat([torch.randperm(num_rows, generator=g) for _ in range(epochs)])[:needed]


# ---- export -----------------------------------------------------------------------------------------

def export_weights(weights: dict, latent: dict[str, torch.Tensor], spec: QuantSpec) -> dict:
    """`weights` with each trained projection replaced by the RTN quantization of its latent weight:
    the fake quantization the last step ran, packed (same group_params, same codes)."""
    out = dict(weights)
    for name, w in latent.items():
        out[name] = QuantizedWeight.from_result(rtn_quantize(w.detach(), spec), spec.bits)
    return out


def fake_quantized(latent: dict[str, torch.Tensor], spec: QuantSpec) -> dict[str, torch.Tensor]:
    """The weights the student's forward used, as dense fp32 tensors."""
    return {n: fake_quant(w.detach(), spec) for n, w in latent.items()}


def qat_quantize(checkpoint, cfg: QATConfig, progress: Progress | None = None,
                 data: tuple[torch.Tensor, dict[str, Any]] | None = None) -> QATResult:
    """The QAT-trained model of `checkpoint` (fp32): text from the FP32 model (or `data`, what
    `generate_rows` returned), cfg.steps of distillation with fake quantization, then the export.
    `result.weights` is a weight dict for `Engine(checkpoint.config, result.weights, ...)`, as
    `layerwise.quantize_model`'s."""
    config = checkpoint.config
    check_fits(cfg, config)
    cfg = replace(cfg, lr=cfg.lr or default_lr(config, checkpoint.weights, cfg.spec))
    start = time.perf_counter()
    rows, provenance = data or generate_rows(checkpoint, cfg)
    student, losses = train(config, checkpoint.weights, rows, cfg, progress)
    latent = {n: p.detach() for n, p in student.params.items()}
    return QATResult(export_weights(checkpoint.weights, latent, cfg.spec), latent, losses,
                     time.perf_counter() - start, provenance, cfg)


def qat_weights(checkpoint, spec: QuantSpec, steps: int, **options: Any) -> dict:
    """The QAT-trained model of `checkpoint` in format `spec` after `steps` steps, as a weight dict
    (QuantizedWeights for the projections) for `Engine(checkpoint.config, weights, fingerprint)`:
    the entry point for accuracy tables. `options` are QATConfig's other fields (lr, batch, ...)."""
    return qat_quantize(checkpoint, QATConfig(spec, steps=steps, **options)).weights


def default_lr(config: ModelConfig, weights: dict, spec: QuantSpec) -> float:
    """Adam's learning rate when none is given: 0.6 % of the median quantization step of the
    projections. Adam moves a weight by about lr per step, so this is the fraction of a rounding
    step a weight can travel per step, whatever the model's weight scale (stories260K INT4 g32:
    1.9e-4, best of a sweep over 50-200 steps; SmolLM2 INT4 g128: 3.8e-4)."""
    steps = [group_params(group_view(weights[n].float(), spec), spec)[0].median() for n in projection_names(config)]
    return float(0.006 * torch.stack(steps).median())


def qat_provenance(checkpoint, result: QATResult) -> dict[str, Any]:
    """The quantization_config's "pdserve" entry of a QAT checkpoint."""
    cfg = result.config
    return {"source": checkpoint.source.name, "source_fingerprint": checkpoint.fingerprint,
            "created_by": "pdserve qat",
            "qat": {"steps": cfg.steps, "lr": cfg.lr, "lr_schedule": "cosine to lr/10", "optimizer": "adam",
                    "batch": cfg.batch, "seq_len": cfg.seq_len, "seed": cfg.seed,
                    "teacher": f"fp32 {checkpoint.source.name}", "loss": "kl(teacher||student), temperature 1",
                    "ce_weight": cfg.ce_weight, "scales": "recomputed from the weights each step (min/max)",
                    "estimator": "straight-through", "final_kl": result.losses[-1],
                    "wall_s": round(result.wall_s, 1)},
            "calibration": result.data}


def save_qat_checkpoint(out_dir: str | Path, checkpoint, result: QATResult) -> Path:
    """Writes the GPTQ-format directory (quantization_config "method": "qat")."""
    from pdserve.quant.checkpoint import quantization_config, save_quantized

    # damp_percent is GPTQ's; QAT has none (0), the key is kept for tools that expect it.
    qconfig = quantization_config(result.config.spec, "qat", 0.0, qat_provenance(checkpoint, result))
    return save_quantized(out_dir, checkpoint, result.weights, qconfig)


# ---- evaluation ---------------------------------------------------------------------------------------

def heldout_logits(config: ModelConfig, weights: dict, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced logits [T, V] of each sequence through the runtime's layers (QuantLinear for
    QuantizedWeights), one sequence at a time."""
    layers, globals_ = build_layers(config, weights), _global_weights(config, weights)
    with torch.inference_mode():
        return [forward_logits(config, globals_, layers, torch.tensor([s]))[0] for s in sequences]


def kl_top1(ref: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float, int]:
    """(mean KL(ref || got), top-1 agreement, positions) over every position of every sequence."""
    kl, agree, n = 0.0, 0, 0
    for r, g in zip(ref, got):
        lr, lg = F.log_softmax(r.double(), -1), F.log_softmax(g.double(), -1)
        kl += (lr.exp() * (lr - lg)).sum().item()
        agree += int((r.argmax(-1) == g.argmax(-1)).sum())
        n += r.shape[0]
    return kl / n, agree / n, n


def heldout_sequences(checkpoint) -> list[list[int]]:
    """Held-out text for measurements, disjoint from the training text: for a chat model, the 12
    `qat_eval_prompts_chat.txt` questions continued by the FP32 model for 32 tokens (seeds 4000..);
    else 32 texts of 256 tokens it writes from BOS (seeds 2000..: stories260k_eval.jsonl's recipe)."""
    tok = checkpoint.tokenizer
    if has_chat_template(tok):
        prompts = EVAL_PROMPTS_CHAT.read_text(encoding="utf-8").splitlines()
        return generate(checkpoint, [prompt_ids(tok, p, True) for p in prompts], 4000, 32)
    return generate(checkpoint, [[tok.bos_id]] * 32, 2000, 256)
