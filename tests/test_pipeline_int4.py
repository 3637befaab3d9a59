"""A pipeline of 4-bit SmolLM2 stages computes what one process's engine does, bit for bit.

A stage of one rank packs its weights as Engine.from_checkpoint does (`stages.pipeline_weights`: the
GGUF's Q8_0 head kept 8-bit; `StageModel(engine=...)`: the dense copies and the prompt rows' kernel), and
tells its int4 projections each row's token kind (`token_kinds`), micro-batches included. Before, the stages
ran a dense head, no copies and rows chosen by count: fp32 logits up to 1.6 off one process's within six
steps, and bf16 greedy tokens that differed. The stages here are threads of the test process over the
production driver and stage loop (tests/pp_threads.py); tests/test_pipeline_parallel.py starts real ones.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams
from pp_threads import threaded_pp_engine

STEPS = 6


def _trace(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of the prompts batched, and every step's logits."""
    engine.keep_logits = True
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    logits = []
    while engine.has_unfinished():
        outs = engine.step()
        logits.append(engine.last_logits[:len(outs)].clone())
    return [list(s.output_ids) for s in seqs], logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pp2_int4_equals_one_process_bit_for_bit(dtype, smollm2, smollm2_bf16):
    checkpoint = smollm2 if dtype == "float32" else smollm2_bf16
    tok = checkpoint.tokenizer
    prompts = [tok.encode(q) for q in ("Write a haiku about the sea.", "List three colors.",
                                       "What is the capital of France? Answer in one word, please.")]
    config = EngineConfig(cache=CacheConfig(num_blocks=64, dtype=dtype), dtype=dtype, weight_format="int4",
                          dense_copy=True, int8_prompts=True)
    tokens, logits = _trace(Engine.from_checkpoint(checkpoint, config), prompts)
    engine, close = threaded_pp_engine(checkpoint, config, stages=2, micro_batches=2)  # decode steps split in 2
    try:
        pp_tokens, pp_logits = _trace(engine, prompts)
    finally:
        close()
    assert pp_tokens == tokens
    assert len(pp_logits) == len(logits) == STEPS
    for step, (got, want) in enumerate(zip(pp_logits, logits)):
        assert torch.equal(got, want), (step, (got - want).abs().max().item())
