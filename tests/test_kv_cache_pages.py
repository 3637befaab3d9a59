"""The CPU KV cache costs memory as its blocks are written, not at allocation (kv_cache.zero_pages)."""

from __future__ import annotations

import gc

import pytest
import torch

from pdserve.runtime.config import CacheConfig, ConfigError, ModelConfig
from pdserve.runtime.kv_cache import KV_DTYPES, allocate_kv_cache, check_fits, memory_available, zero_pages

MiB = 1 << 20


def status_mib(field: str) -> float:
    """VmRSS / VmSize of this process, MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def big_model() -> ModelConfig:
    # SmolLM2-135M's cache shape (30 layers, 3 KV heads of 64): 4096 blocks of 16 tokens, 2.9 GB fp32.
    return ModelConfig(architecture="llama", vocab_size=256, hidden_size=576, intermediate_size=1536,
                       num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def test_a_large_cache_is_not_resident_until_written():
    gc.collect()
    before = status_mib("VmRSS")
    cache = allocate_kv_cache(big_model(), CacheConfig(num_blocks=4096), "cpu")
    assert cache.nbytes > 2800 * MiB
    assert status_mib("VmRSS") - before < 64  # torch.zeros: +2.9 GB here
    assert cache.is_contiguous() and cache.dtype == torch.float32
    for bid in (0, 1234, 4095):  # reads as zeros (reading maps the shared zero page)
        assert not cache[bid].any()
    cache[7] = 1.5  # one block written: resident now, about its size
    block_mib = cache[7].nbytes / MiB
    grown = status_mib("VmRSS") - before
    assert block_mib <= grown < 64 + block_mib
    assert float(cache[7].sum()) == 1.5 * cache[7].numel() and not cache[8].any()
    size = status_mib("VmSize")
    del cache
    gc.collect()
    assert size - status_mib("VmSize") > 2800  # the mapping went with the tensor


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_every_kv_dtype_maps_to_a_zero_tensor_of_its_shape(name):
    dtype = KV_DTYPES[name]
    t = zero_pages((5, 3, 2, 16, 2, 8), dtype)
    assert t.dtype == dtype and t.shape == (5, 3, 2, 16, 2, 8) and t.is_contiguous()
    assert not t.view(torch.uint8).any()
    t[2] = torch.ones((3, 2, 16, 2, 8)).to(dtype)
    assert torch.equal(t[2].float(), torch.ones((3, 2, 16, 2, 8))) and not t[1].view(torch.uint8).any()
    assert torch.equal(t.clone(), t)


def test_an_empty_shape_is_an_empty_tensor():
    assert zero_pages((0, 4), torch.float32).shape == (0, 4)


def test_a_cache_larger_than_the_memory_available_is_refused_at_start():
    """Mapped lazily, it would start, and the OOM killer would end the worker once its blocks filled."""
    with pytest.raises(ConfigError, match=r"^--num-blocks 10000000: the KV cache would take 6866\.5 GiB "
                                          r"\(0\.70 MiB a block\), more than the .* GiB this machine has available; "
                                          r"at most \d+ blocks fit"):
        allocate_kv_cache(big_model(), CacheConfig(num_blocks=10_000_000), "cpu")
    check_fits(4096, 1 << 20, available=4096 << 20)  # exactly fits
    with pytest.raises(ConfigError, match=r"at most 4095 blocks fit"):
        check_fits(4096, 1 << 20, available=(4096 << 20) - 1)
    available = memory_available()
    assert available is None or available > 0
