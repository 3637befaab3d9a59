"""KVFormat: block identity (hashes chained over the prefix, the format in them) and the rule that
the block of the last token is always computed."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.block_hash import block_hash
from pdserve.runtime.kv_format import KVFormat

FMT = KVFormat.named("ab" * 16, "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


@pytest.mark.parametrize(("tokens", "reusable"), [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_the_block_of_the_last_token_is_never_reusable(tokens: int, reusable: int):
    assert FMT.reusable_blocks(tokens) == reusable
    assert len(FMT.reusable_hashes(list(range(tokens)))) == reusable


def test_hashes_chain_over_the_prefix_and_name_the_format():
    ids = list(range(40))
    full = FMT.full_block_hashes(ids)
    assert full == [block_hash(None, ids[:16], FMT.fingerprint, "float32"),
                    block_hash(full[0], ids[16:32], FMT.fingerprint, "float32")]
    assert FMT.prompt_hashes(ids)[:2] == full and len(FMT.prompt_hashes(ids)) == 3  # + the partial tail
    assert FMT.with_kv_dtype("int8").full_block_hashes(ids) != full  # another format, other names
    assert FMT.full_block_hashes([9] + ids[1:])[1] != full[1]  # a changed prefix changes every later block


def test_kv_dtype_of_tells_another_format_from_another_model():
    ids = list(range(20))
    assert FMT.kv_dtype_of(ids, FMT.with_kv_dtype("int8").prompt_hashes(ids)) == "int8"
    assert FMT.kv_dtype_of(ids, FMT.prompt_hashes(ids)) == "float32"
    other_model = KVFormat.named("cd" * 16, "float32", 2, 2, 8, 16)
    assert FMT.kv_dtype_of(ids, other_model.prompt_hashes(ids)) is None


def test_layout():
    assert FMT.shape == (2, 2, 16, 2, 8) and FMT.payload_bytes == 2 * 2 * 16 * 2 * 8 * 4
    assert FMT.with_kv_dtype("int8").shape == (2, 2, 17, 2, 8)  # the scale row
    assert FMT.blocks_for(33) == 3
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVFormat("ab" * 16, torch.float64, 2, 2, 8, 16)


def test_the_gateways_names_are_the_workers_and_cover_every_kv_dtype():
    """runtime.block_names (the gateway's, without torch) lists the --kv-dtype names of kv_cache's
    storage dtypes, in their order (`kv_dtype_of` tries them so), and KVFormat names through it."""
    from pdserve.runtime.block_names import BlockNames
    from pdserve.runtime.config import KV_DTYPE_NAMES
    from pdserve.runtime.kv_cache import KV_DTYPES

    assert tuple(KV_DTYPES) == KV_DTYPE_NAMES
    spec = KVFormat.named("ab" * 16, "int8", 2, 2, 8, 16)
    names = BlockNames("ab" * 16, "int8", 16)
    prompt = list(range(40))
    assert spec.names == names and spec.prompt_hashes(prompt) == names.prompt_hashes(prompt)
    assert names.kv_dtype_of(prompt, BlockNames("ab" * 16, "bfloat16", 16).prompt_hashes(prompt)) == "bfloat16"
    with pytest.raises(ValueError, match="unsupported KV dtype 'float64'"):
        BlockNames("ab" * 16, "float64", 16)
