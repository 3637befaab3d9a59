"""The last layer computed for the rows that sample only (`OutputRows`, llama.cpp's `inp_out_ids`): every
row's K/V is still written, and the kept rows' logits are those of the whole layer, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime import model as model_module
from pdserve.runtime.attention import AttentionMetadata, OutputRows, PrefillSpan
from pdserve.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.runtime.engine import Engine
from pdserve.runtime.kernels.cpu_decode_step import DecodeStepPlan
from pdserve.runtime.sampling_params import SamplingParams


def _meta(decodes: int, chunks: list[int]) -> AttentionMetadata:
    spans, start = [], decodes
    for n in chunks:
        spans.append(PrefillSpan(start, n, n, torch.zeros(1, dtype=torch.long)))
        start += n
    return AttentionMetadata(torch.zeros(start, dtype=torch.long), decodes, torch.zeros(decodes, 1, dtype=torch.long),
                             torch.ones(decodes, dtype=torch.long), tuple(spans))


def _rows(*rows: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def test_kept_rows_are_every_decode_and_a_tail_of_each_chunk():
    meta = _meta(2, [5, 3, 4])  # rows 0-1 decode, chunks 2-6, 7-9, 10-13
    kept = OutputRows.of(meta, _rows(0, 1, 6, 12, 13))
    assert kept is not None and kept.tails == (1, 0, 2)
    assert OutputRows.of(meta, _rows(0, 1, 5, 6)).tails == (2, 0, 0)


@pytest.mark.parametrize("rows", [
    (1, 6),  # a decode row left out
    (0, 1, 4, 6),  # a chunk's rows with a gap: not its tail
    (0, 1, 6, 1),  # not ascending
    (0, 1, 6, 14),  # a row past the step
    tuple(range(14)),  # every row: nothing to leave out
])
def test_rows_that_are_not_such_a_selection_keep_the_whole_layer(rows):
    assert OutputRows.of(_meta(2, [5, 3, 4]), _rows(*rows)) is None


def _trace(checkpoint, config: EngineConfig, kept_on: bool, monkeypatch) -> dict:
    """Greedy requests arriving over several steps (chunked prompts beside decodes): every step's logits,
    the tokens, the KV cache, and how many steps left rows out of the last layer."""
    engaged, split, in_split = [0], [0], [False]
    plan, split_forward = model_module.LlamaModel._kept_rows, model_module.LlamaModel._split_forward

    def kept_rows(self, meta, output_rows):
        kept = plan(self, meta, output_rows) if kept_on else None
        engaged[0] += kept is not None
        split[0] += kept is not None and in_split[0]
        return kept

    def split_rows(self, *args):
        in_split[0] = True
        try:
            return split_forward(self, *args)
        finally:
            in_split[0] = False

    monkeypatch.setattr(model_module.LlamaModel, "_kept_rows", kept_rows)
    monkeypatch.setattr(model_module.LlamaModel, "_split_forward", split_rows)
    engine = Engine.from_checkpoint(checkpoint, config)
    engine.keep_logits = True
    prompts = [[1 + (i * 37 + j * 11) % 4000 for j in range(n)] for i, n in enumerate((70, 23, 45, 9))]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    logits, tokens, step = [], {}, 0
    while prompts or engine.has_unfinished():
        if prompts and step % 2 == 0:
            engine.add_request(f"r{step}", prompts.pop(0), params)
        step += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        logits.append(engine.last_logits.clone())
    monkeypatch.undo()
    return {"logits": logits, "tokens": tokens, "kv": engine.runner.kv_cache.clone(), "engaged": engaged[0],
            "in_split": split[0]}


def _config(dtype: str, dense_copy: bool) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(num_blocks=64, dtype=dtype), dtype=dtype, weight_format="int4",
                        dense_copy=dense_copy, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kept_rows_logits_and_kv_are_the_whole_layers_bit_for_bit(dtype, smollm2, smollm2_bf16, monkeypatch):
    """A worker's engine (int4 projections, the dense copy: prompt rows on a row-invariant GEMM): steps that
    leave rows out of the last layer give the logits, tokens and KV of the whole layer. Checked to fail
    with a lone kept prompt row on the few-row int8 kernel (the no-copy engine's choice by row count)."""
    checkpoint = smollm2_bf16 if dtype == "bfloat16" else smollm2
    kept = _trace(checkpoint, _config(dtype, True), True, monkeypatch)
    whole = _trace(checkpoint, _config(dtype, True), False, monkeypatch)
    assert kept["engaged"] > 0 and whole["engaged"] == 0
    if DecodeStepPlan.of(Engine.from_checkpoint(checkpoint, _config(dtype, True)).runner.model) is not None:
        # mixed steps too: the decode rows in the one-call C step, the prompt rows kept
        assert kept["in_split"] > 0, kept["in_split"]
    assert kept["tokens"] == whole["tokens"]
    assert len(kept["logits"]) == len(whole["logits"])
    for a, b in zip(kept["logits"], whole["logits"]):
        assert torch.equal(a, b)
    assert torch.equal(kept["kv"], whole["kv"])


def test_projections_that_choose_by_row_count_keep_the_whole_layer(smollm2_bf16, monkeypatch):
    """bf16 without the dense copy picks a projection's kernel by its row count (a lone row: int8 inputs),
    so leaving rows out would change the kept rows' sums: the last layer stays whole there."""
    trace = _trace(smollm2_bf16, _config("bfloat16", False), True, monkeypatch)
    assert trace["engaged"] == 0
