"""The CUDA-graph decode path's host side, checked on the CPU: batch-size buckets, padding rows
that write no KV and attend to nothing, and graph inputs equal to the eager step's inputs.
(Capture and replay themselves need a GPU: tests/gpu/test_model_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.cuda_graph import PAD_SLOT, DecodeBatch, StaticDecodeBuffers, capture_sizes, padded_size
from pdserve.runtime.sampling_params import SamplingParams
from conftest import model_config_from_hf, random_hf_model


def test_capture_sizes_cover_every_batch_up_to_the_max() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert capture_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    sizes = capture_sizes(100)
    for b in range(1, 101):
        p = padded_size(b, sizes)
        assert p is not None and b <= p and p in sizes
        assert p - b < max(8, b // 2 + 1)  # padding stays a bounded fraction of the batch
    assert padded_size(101, sizes) is None
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_fill_pads_rows_inertly_and_overwrites_the_previous_step() -> None:
    buf = StaticDecodeBuffers(max_batch=8, max_blocks_per_seq=4, device="cpu")
    big = DecodeBatch([5] * 6, [40] * 6, [99] * 6, [[1, 2, 3]] * 6, [41] * 6)
    buf.fill(big, 8)
    small = DecodeBatch([7, 8, 9], [3, 17, 0], [19, 33, 48], [[1], [2, 3], [4]], [4, 18, 1])
    buf.fill(small, 4)
    meta = buf.metadata(4)
    assert buf.token_ids[:4].tolist() == [7, 8, 9, 0]
    assert buf.positions[:4].tolist() == [3, 17, 0, 0]
    assert meta.slot_mapping.tolist() == [19, 33, 48, PAD_SLOT]
    assert meta.decode_context_lens.tolist() == [4, 18, 1, 0]
    assert meta.decode_block_tables.tolist() == [[1, 0, 0, 0], [2, 3, 0, 0], [4, 0, 0, 0], [0, 0, 0, 0]]
    assert meta.num_decode_tokens == 4 and meta.prefills == ()
    # The metadata views alias the buffers: a graph captured on them sees every later fill.
    assert meta.slot_mapping.data_ptr() == buf.slots.data_ptr()


def test_fill_refuses_what_does_not_fit() -> None:
    buf = StaticDecodeBuffers(max_batch=4, max_blocks_per_seq=2, device="cpu")
    with pytest.raises(ValueError, match="does not fit"):
        buf.fill(DecodeBatch([1] * 3, [0] * 3, [0] * 3, [[0]] * 3, [1] * 3), 8)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        buf.fill(DecodeBatch([1], [40], [40], [[0, 1, 2]], [41]), 1)


def test_graph_inputs_equal_the_eager_step_inputs(make_engine) -> None:
    """For every decode-only step of a real run, the graph runner's host rows equal the eager inputs."""
    hf = random_hf_model()
    engine = make_engine(model_config_from_hf(hf.config, "llama"), hf.state_dict(), block_size=4, num_blocks=64)
    runner, eager_run, checked = engine.runner, engine.runner.run, []

    def run_and_compare(out):
        if out.decodes and not out.prefills:
            ids, pos, meta, rows = runner._prepare(out)
            batch = runner._decode_batch(out.decodes)
            assert batch.token_ids == ids.tolist()
            assert batch.positions == pos.tolist()
            assert batch.slots == meta.slot_mapping.tolist()
            assert batch.context_lens == meta.decode_context_lens.tolist()
            width = meta.decode_block_tables.shape[1]
            assert [t + [0] * (width - len(t)) for t in batch.block_tables] == meta.decode_block_tables.tolist()
            assert rows.tolist() == list(range(len(out.decodes)))  # every decode row samples
            checked.append(len(out.decodes))
        return eager_run(out)

    runner.run = run_and_compare
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.generate([list(range(3, 3 + n)) for n in (3, 9, 14)], params)
    assert 3 in checked  # decode steps with all three sequences (and block boundaries crossed)
