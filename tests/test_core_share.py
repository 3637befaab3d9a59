"""The host's core share (pdserve.runtime.core_share): a prefill worker's claim seen by a decode
worker in another process, its expiry, the decode side's thread choice before a step and between
layers, and a real engine decoding the same bits whatever threads its steps and layers ran on."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from pdserve.runtime import compute_threads, core_share
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.core_share import HOLD_S, CoreShare, DecodeCores, PrefillCores
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams


def test_a_claim_written_by_another_process_is_seen_until_released(tmp_path):
    path = tmp_path / "cores"
    share = CoreShare(path)
    assert not share.prefill_busy()
    script = ("import sys; from pdserve.runtime.core_share import CoreShare, PrefillCores\n"
              "side = PrefillCores(CoreShare(sys.argv[1]), 3); side.before_step(); print('held', flush=True)\n"
              "sys.stdin.readline(); side.idle(); print('idle', flush=True); sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert share.prefill_busy()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "idle"
        assert not share.prefill_busy()
    finally:
        child.kill()
        child.wait()


def test_a_claim_lapses_after_hold_s_and_a_time_from_before_a_reboot_is_ignored(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: now[0])
    share = CoreShare(tmp_path / "cores")
    share.hold(0)
    now[0] += HOLD_S * 0.9
    assert share.prefill_busy()
    now[0] += HOLD_S * 0.2  # its worker died without releasing: forgotten
    assert not share.prefill_busy()
    share.hold(1)
    now[0] -= 100.0  # the clock restarted (a reboot) under a file left behind
    assert not share.prefill_busy()
    with pytest.raises(ValueError, match="slot"):
        PrefillCores(share, core_share.MAX_SLOTS)


def test_decode_widens_while_no_prefill_computes_and_narrows_between_layers_when_one_starts(tmp_path):
    """A step starts wide while no prefill worker computes (OpenMP and a one-call C step's budget),
    and a prefill claim narrows both from the next layer."""
    share, calls = CoreShare(tmp_path / "cores"), []
    cores = DecodeCores(share, wide=2, narrow=1, set_threads=calls.append)
    cores.before_step()
    assert (cores.budget, cores.threads, calls) == (2, 2, [2])
    cores.between_layers()
    cores.between_layers()
    assert (cores.threads, calls) == (2, [2])
    share.hold(0)  # a prompt arrives mid-step
    cores.between_layers()
    cores.between_layers()
    assert (cores.budget, cores.threads, calls) == (1, 1, [2, 1])  # one switch, not one a layer
    cores.before_step()
    cores.between_layers()
    assert (cores.budget, calls) == (1, [2, 1])
    share.release(0)
    cores.before_step()
    cores.between_layers()
    assert (cores.budget, cores.threads, calls, cores.switches) == (2, 2, [2, 1, 2], 3)
    with pytest.raises(ValueError):
        DecodeCores(share, wide=1, narrow=2, set_threads=calls.append)


def test_switching_threads_between_steps_and_layers_changes_no_bit(smollm2_bf16, tmp_path):
    """8 sequences (torch's int4 kernel), then 24 (the dense copy): decoded on one thread throughout,
    and with the count switched between 1 and 2 by a prefill claim toggled every few layers."""
    prompts = [smollm2_bf16.tokenizer.encode(f"List {i} animals:") for i in range(24)]

    def decode(toggle: bool) -> list[torch.Tensor]:
        engine = Engine.from_checkpoint(smollm2_bf16, EngineConfig(
            cache=CacheConfig(num_blocks=128, dtype="bfloat16"), dtype="bfloat16", dense_copy=True))
        engine.keep_logits = True
        share = CoreShare(tmp_path / f"cores-{toggle}")
        cores = DecodeCores(share, 2, 1, compute_threads.thread_setter())
        if toggle:
            layers = [0]

            def between() -> None:
                layers[0] += 1
                if layers[0] % 7 == 0:
                    share.release(0) if share.prefill_busy() else share.hold(0)
                cores.between_layers()
            engine.runner.model.between_layers = between
        logits = []
        for batch in (prompts[:8], prompts[8:]):
            for i, ids in enumerate(batch):
                engine.add_request(f"{len(batch)}-{i}", ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            while engine.has_unfinished():
                if toggle:
                    cores.before_step()
                engine.step()
                logits.append(engine.last_logits.clone())
        if toggle:
            assert cores.switches >= 4
        return logits

    box = {}

    def run() -> None:  # a thread of its own: the OpenMP count set is this thread's
        compute_threads.claim(1)
        box["one"], box["switched"] = decode(False), decode(True)
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert len(box["one"]) == len(box["switched"])
    for a, b in zip(box["one"], box["switched"]):
        assert torch.equal(a, b)
