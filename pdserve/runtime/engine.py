"""Engine: the serving loop of one worker. One step = schedule, run, postprocess.

    add_request ──▶ Scheduler.waiting ──schedule()──▶ SchedulerOutput
        ──ModelRunner.run()──▶ logits ──sample()──▶ tokens appended, stop checks
        ──▶ StepOutput per request (new tokens, finish reason); finished blocks freed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from pdserve.runtime.block_manager import BlockManager
from pdserve.runtime.config import EngineConfig, ModelConfig
from pdserve.runtime.kv_cache import allocate_kv_cache
from pdserve.runtime.kv_transfer import (ExportedBlock, export_prompt_blocks, import_prefix_blocks,
                                         import_prompt_blocks)
from pdserve.runtime.model import LlamaModel
from pdserve.runtime.model_runner import ModelRunner
from pdserve.runtime.sampler import sample
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.runtime.scheduler import Scheduler, SchedulerOutput
from pdserve.runtime.sequence import Sequence, SequenceStatus, TokenLogprob


class RequestError(ValueError):
    """A request the engine cannot take (empty, too long, bad token ids); the message says why."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the client should retry later."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str  # "" while running, then "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    tokens_computed: int = 0  # tokens run through the model (prefill chunks + decodes)
    max_batch_size: int = 0
    batch_size_counts: dict[int, int] | None = None


class Engine:
    def __init__(self, model_config: ModelConfig, weights: dict[str, torch.Tensor], fingerprint: str,
                 config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.model_config = model_config
        self.fingerprint = fingerprint
        cache = self.config.cache
        self.block_manager = BlockManager(cache.num_blocks, cache.block_size, fingerprint, cache.dtype)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.kv_cache = allocate_kv_cache(model_config, cache, self.config.device)
        model = LlamaModel(model_config, weights, self.config.device)
        self.runner = ModelRunner(model, self.kv_cache, cache.block_size, self.config.device)
        if self.config.cuda_graph:  # a no-op off the GPU
            widest = -(-model_config.max_position_embeddings // cache.block_size)
            self.runner.enable_cuda_graphs(self.config.scheduler.max_num_seqs, widest)
        self.seqs: dict[str, Sequence] = {}  # queued or running
        self.held: dict[str, Sequence] = {}  # finished, KV kept until exported and released
        self.stats = EngineStats(batch_size_counts={})
        self.keep_logits = False  # tests and debugging: keep the last step's logits
        self.last_logits: torch.Tensor | None = None  # [S, V], rows in the order of step()'s outputs

    @classmethod
    def from_checkpoint(cls, checkpoint, config: EngineConfig | None = None) -> "Engine":
        return cls(checkpoint.config, checkpoint.weights, checkpoint.fingerprint, config)

    # ---- requests -------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError with a message a person can act on."""
        c = self.model_config
        if not prompt_ids:
            raise RequestError("prompt is empty: send at least one token")
        if min(prompt_ids) < 0 or max(prompt_ids) >= c.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {c.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > c.max_position_embeddings:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the"
                f" context window of {c.max_position_embeddings} tokens: shorten the prompt or lower max_tokens")
        if self.block_manager.blocks_for(total) > self.block_manager.num_blocks:
            raise RequestError(f"request needs {total} tokens of KV but the cache holds only"
                               f" {self.block_manager.num_blocks * self.block_manager.block_size}")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    output_ids: list[int] | None = None, hold_blocks: bool = False) -> Sequence:
        """Queues a request. `output_ids`: tokens already generated elsewhere (their KV is
        recomputed here); `hold_blocks`: keep the KV after the request ends, for export."""
        seq = self._new_sequence(request_id, prompt_ids, params, output_ids or [])
        seq.hold_blocks = hold_blocks
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, params: SamplingParams,
                      block_hashes: list[bytes], blocks: Mapping[bytes, torch.Tensor]) -> bool:
        """Queues a request whose prompt KV was computed elsewhere, for decoding. Blocks that
        are cached here are shared, the others copied from `blocks`. Returns False when KV was
        missing or did not fit: the request is then queued to recompute its prompt here."""
        seq = self._new_sequence(request_id, prompt_ids, params, [first_token])
        imported = import_prompt_blocks(self, seq, block_hashes, blocks)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return imported

    def add_with_prefix(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        blocks: Mapping[bytes, torch.Tensor], *, hold_blocks: bool = False,
                        resumed_tokens: int = 0) -> int:
        """Queues a request whose leading full blocks are taken from this engine's cache or from
        `blocks` (KV computed elsewhere) instead of computed; returns the prompt tokens reused.
        `resumed_tokens`: the prompt's last tokens were generated by this request before (a
        resumed stream), which seeded sampling counts."""
        seq = self._new_sequence(request_id, prompt_ids, params, [])
        seq.hold_blocks = hold_blocks
        seq.resumed_tokens = resumed_tokens
        imported = import_prefix_blocks(self, seq, blocks)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return imported * self.block_manager.block_size

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      output_ids: list[int]) -> Sequence:
        if request_id in self.seqs or request_id in self.held:
            raise RequestError(f"request id {request_id!r} is already running")
        self.validate(prompt_ids, params)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests already wait: retry later")
        return Sequence(request_id, list(prompt_ids), params, output_ids=list(output_ids))

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return self.release_held(request_id)
        self.scheduler.finish(seq, "abort")
        return True

    def export_held(self, request_id: str, skip: Collection[bytes] = ()) -> list[ExportedBlock]:
        """The prompt KV blocks of a finished request that holds its blocks (but those in `skip`)."""
        return export_prompt_blocks(self, self.held[request_id], skip)

    def release_held(self, request_id: str) -> bool:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)
        return seq is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        logits = self.runner.run(out)  # [S, V]
        if self.keep_logits:
            self.last_logits = logits
        sampling = self._advance(out)
        self._record_batch(len(out.scheduled))
        self.stats.tokens_computed += sum(s.num_new_tokens for s in out.scheduled)
        results = sample(logits, sampling)
        return [self._postprocess(seq, tok, lp) for seq, (tok, lp) in zip(sampling, results)]

    def _advance(self, out: SchedulerOutput) -> list[Sequence]:
        """Marks the step's tokens computed; returns the sequences that sample, in row order."""
        sampling = []
        for s in out.scheduled:
            if s.samples:
                sampling.append(s.seq)
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit_full_blocks(s.seq)
        return sampling

    def _postprocess(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> StepOutput:
        seq.output_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        self.stats.tokens_generated += 1
        reason = self._finish_reason(seq, token)
        ends = bool(reason) or seq.hold_blocks  # a held (prefill-role) request ends after one token
        if ends:
            self.scheduler.finish(seq, reason, free_blocks=not seq.hold_blocks)
            self.seqs.pop(seq.request_id, None)
            if seq.hold_blocks:
                self.held[seq.request_id] = seq
        return StepOutput(seq.request_id, [token], [lp] if lp else [], ends, reason,
                          len(seq.prompt_ids), seq.num_cached_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> str:
        p = seq.params
        if (not p.ignore_eos and token in self.model_config.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens:
            return "length"
        return ""

    def _record_batch(self, size: int) -> None:
        s = self.stats
        s.steps += 1
        s.max_batch_size = max(s.max_batch_size, size)
        s.batch_size_counts[size] = s.batch_size_counts.get(size, 0) + 1

    # ---- conveniences ---------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Runs `prompts` to completion with continuous batching; returns finished sequences."""
        seqs = [self.add_request(f"gen-{id(self)}-{i}", p, params) for i, p in enumerate(prompts)]
        while self.has_unfinished():
            self.step()
        return seqs

    def check_leaks(self) -> None:
        live = [s for s in self.seqs.values() if s.status is not SequenceStatus.FINISHED]
        self.block_manager.check_leaks(live + list(self.held.values()))
