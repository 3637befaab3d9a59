"""--dtype: resolution of "auto", the KV format following it, and KV of different dtypes never mixing."""

from __future__ import annotations

import argparse

import pytest
import torch

from conftest import STORIES_GGUF
from pdserve.engine_args import add_worker_args, build_engine, resolved_dtypes
from pdserve.runtime.block_hash import prompt_block_hashes
from pdserve.runtime.config import ConfigError, resolve_compute_dtype
from pdserve.runtime.loader import compute_fingerprint, load_checkpoint


def test_auto_resolves_per_device() -> None:
    assert resolve_compute_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_compute_dtype("auto", "cpu") in ("bfloat16", "float32")  # bf16 only where the CPU has it
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_compute_dtype(name, "cpu") == name
    with pytest.raises(ConfigError, match="unknown compute dtype 'int8'"):
        resolve_compute_dtype("int8")


def test_kv_dtype_follows_unless_given() -> None:
    assert resolved_dtypes("bfloat16", None) == ("bfloat16", "bfloat16")
    assert resolved_dtypes("float32", None) == ("float32", "float32")
    assert resolved_dtypes("bfloat16", "int8") == ("bfloat16", "int8")


def test_compute_dtype_is_in_the_block_hashes() -> None:
    fp = load_checkpoint(STORIES_GGUF).fingerprint
    assert compute_fingerprint(fp, "float32") == fp  # fp32 KV stored before --dtype stays valid
    assert len({compute_fingerprint(fp, d) for d in ("float32", "bfloat16", "float16")}) == 3
    prompt = list(range(3, 40))
    # The same KV format (bfloat16), different compute dtypes: no block hash in common.
    fp32_compute = prompt_block_hashes(prompt, 16, compute_fingerprint(fp, "float32"), "bfloat16")
    bf16_compute = prompt_block_hashes(prompt, 16, compute_fingerprint(fp, "bfloat16"), "bfloat16")
    assert not set(fp32_compute) & set(bf16_compute)


def worker_args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p, "127.0.0.1:0")
    return p.parse_args(["--model", str(STORIES_GGUF), "--num-blocks", "16", *flags])


def test_workers_load_and_compute_in_their_dtype() -> None:
    fp32, ck = build_engine(worker_args("--dtype", "float32"))
    bf16, _ = build_engine(worker_args("--dtype", "bfloat16"))
    assert fp32.kv_cache.dtype == torch.float32 and bf16.kv_cache.dtype == torch.bfloat16
    assert bf16.runner.model.embed.dtype == torch.bfloat16
    assert fp32.fingerprint == ck.fingerprint != bf16.fingerprint
    mixed, _ = build_engine(worker_args("--dtype", "bfloat16", "--kv-dtype", "float32"))
    assert mixed.kv_cache.dtype == torch.float32 and mixed.fingerprint == bf16.fingerprint


def test_pdserve_up_passes_one_resolved_dtype_to_every_child() -> None:
    from pdserve.cli import build_parser
    from pdserve.commands.up import plan

    args = build_parser().parse_args(["up", "--dtype", "auto", "--served-model-name", "chat", "--no-internal-token"])
    workers, gateway = plan(args)
    expected = resolve_compute_dtype("auto")
    for spec in [*(w for w in workers if w.name != "kvstore"), gateway]:
        cmd = list(spec.command)
        assert cmd[cmd.index("--dtype") + 1] == expected and cmd[cmd.index("--kv-dtype") + 1] == expected
    gw = list(gateway.command)
    assert gw[gw.index("--served-model-name") + 1] == "chat"


def test_the_dense_copy_is_kept_but_by_fp32_decode_workers_by_default() -> None:
    from pdserve.cli import build_parser
    from pdserve.engine_args import engine_config_from_args

    def config(role: str, *flags: str):
        argv = [role, "--model", str(STORIES_GGUF), *flags]
        return engine_config_from_args(build_parser().parse_args(argv))

    assert config("prefill", "--dtype", "float32").dense_copy
    assert config("bench-engine", "--dtype", "float32").dense_copy  # an engine of its own computes prompts
    assert not config("decode", "--dtype", "float32").dense_copy
    assert config("decode", "--dtype", "bfloat16").dense_copy  # decode steps of 16+ sequences run dense
    assert not config("prefill", "--dense-copy", "off").dense_copy
    assert config("decode", "--dtype", "float32", "--dense-prefill-copy", "on").dense_copy  # the old name
    from pdserve.commands.up import plan

    workers, _ = plan(build_parser().parse_args(["up", "--dense-copy", "off", "--int8-prompts", "off",
                                                 "--no-internal-token"]))
    for spec in (w for w in workers if w.name != "kvstore"):  # up passes the choice to every worker
        cmd = list(spec.command)
        assert cmd[cmd.index("--dense-copy") + 1] == "off" and cmd[cmd.index("--int8-prompts") + 1] == "off"
