"""The host's core share (pdserve.runtime.core_share): a prefill worker's claim seen by a decode
worker in another process, its expiry, a worker's thread choice before a step and between layers
(either kind), and real engines decoding and computing prompts with the same bits whatever threads
their steps and layers ran on."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from pdserve.runtime import compute_threads, core_share
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.core_share import HOLD_S, CoreShare, WorkerCores
from pdserve.runtime.engine import Engine
from pdserve.runtime.sampling_params import SamplingParams


def test_a_claim_written_by_another_process_is_seen_until_released(tmp_path):
    path = tmp_path / "cores"
    share = CoreShare(path)
    assert not share.busy("prefill")
    script = ("import sys; from pdserve.runtime.core_share import CoreShare, WorkerCores\n"
              "side = WorkerCores(CoreShare(sys.argv[1]), 'prefill', 3, 1, 1, print)\n"
              "side.before_step(); print('held', flush=True)\n"
              "sys.stdin.readline(); side.idle(); print('idle', flush=True); sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert share.busy("prefill") and not share.busy("decode")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "idle"
        assert not share.busy("prefill")
    finally:
        child.kill()
        child.wait()


def test_a_claim_lapses_after_hold_s_and_a_time_from_before_a_reboot_is_ignored(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: now[0])
    share = CoreShare(tmp_path / "cores")
    share.hold("prefill", 0)
    now[0] += HOLD_S * 0.9
    assert share.busy("prefill")
    now[0] += HOLD_S * 0.2  # its worker died without releasing: forgotten
    assert not share.busy("prefill")
    share.hold("decode", 63)
    assert share.busy("decode") and not share.busy("prefill")  # the last decode slot is not a prefill one
    now[0] -= 100.0  # the clock restarted (a reboot) under a file left behind
    assert not share.busy("decode")
    with pytest.raises(ValueError, match="slot"):
        WorkerCores(share, "prefill", core_share.MAX_SLOTS, 1, 1, print)
    with pytest.raises(ValueError, match="kinds"):
        share.hold("gateway", 0)


def test_a_step_longer_than_hold_s_keeps_its_claim_through_its_layers(tmp_path, monkeypatch):
    """A prefill step of many tokens on one thread outlasts HOLD_S: its claim is held again between
    layers, so the decode worker keeps seeing it (and stays narrow) until the step ends and it idles."""
    now = [1000.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: now[0])
    share = CoreShare(tmp_path / "cores")
    prefill = WorkerCores(share, "prefill", 0, wide=2, narrow=1, set_threads=lambda n: None)
    decode = WorkerCores(share, "decode", 0, wide=2, narrow=1, set_threads=lambda n: None)
    prefill.before_step()
    for _ in range(30):  # 30 layers, each 0.1 HOLD_S: the step lasts 3 HOLD_S
        now[0] += HOLD_S * 0.1
        prefill.between_layers()
    decode.before_step()
    assert share.busy("prefill") and decode.budget == 1
    prefill.idle()
    decode.before_step()
    assert decode.budget == 2


@pytest.mark.parametrize("kind,other", [("decode", "prefill"), ("prefill", "decode")])
def test_a_worker_widens_while_the_other_kind_idles_and_narrows_between_layers_when_it_starts(tmp_path, kind,
                                                                                              other):
    """A step starts wide while no worker of the other kind computes (OpenMP and a one-call C step's
    budget), and the other kind's claim narrows both from the next layer. Its own claim is held for
    each step and released when it idles."""
    share, calls = CoreShare(tmp_path / "cores"), []
    cores = WorkerCores(share, kind, 2, wide=2, narrow=1, set_threads=calls.append)
    cores.before_step()
    assert (cores.budget, cores.threads, calls) == (2, 2, [2]) and share.busy(kind)
    cores.between_layers()
    cores.between_layers()
    assert (cores.threads, calls) == (2, [2])
    share.hold(other, 0)  # the other kind starts computing mid-step
    cores.between_layers()
    cores.between_layers()
    assert (cores.budget, cores.threads, calls) == (1, 1, [2, 1])  # one switch, not one a layer
    cores.before_step()
    cores.between_layers()
    assert (cores.budget, calls) == (1, [2, 1])
    share.release(other, 0)
    cores.before_step()
    cores.between_layers()
    assert (cores.budget, cores.threads, calls, cores.switches) == (2, 2, [2, 1, 2], 3)
    cores.idle()
    assert not share.busy(kind)
    with pytest.raises(ValueError):
        WorkerCores(share, kind, 0, wide=1, narrow=2, set_threads=calls.append)


def test_a_step_widens_between_layers_once_the_other_kind_idles(tmp_path):
    """A prefill step that began narrow beside a computing decode worker takes both cores from the
    next layer once the decode worker idles or yields, not only from its next step."""
    share, calls = CoreShare(tmp_path / "cores"), []
    share.hold("decode", 0)
    prefill = WorkerCores(share, "prefill", 0, wide=2, narrow=1, set_threads=calls.append)
    prefill.before_step()
    prefill.between_layers()
    assert (prefill.budget, calls) == (1, [])
    share.release("decode", 0)
    prefill.between_layers()
    prefill.between_layers()
    assert (prefill.budget, prefill.threads, calls) == (2, 2, [2])


def test_a_decode_worker_yields_to_a_computing_prefill_worker_for_at_most_yield_s(tmp_path, monkeypatch):
    """While a prefill worker computes and the decode batch has room, the decode worker yields (so
    the prefill worker widens), until yield_s after its last step began: then it steps, narrow,
    and the prefill worker narrows at its next layer. Never with a full batch, an idle prefill
    worker, or yield_s 0."""
    now = [1000.0]
    monkeypatch.setattr(core_share.time, "monotonic", lambda: now[0])
    share = CoreShare(tmp_path / "cores")
    prefill = WorkerCores(share, "prefill", 0, wide=2, narrow=1, set_threads=lambda n: None)
    decode = WorkerCores(share, "decode", 0, wide=2, narrow=1, set_threads=lambda n: None, yield_s=0.3)
    never = WorkerCores(share, "decode", 1, wide=2, narrow=1, set_threads=lambda n: None)
    decode.before_step()
    assert not decode.yields(4, 32)  # no prefill worker computes
    prefill.before_step()
    assert prefill.budget == 1
    now[0] += 0.1
    assert decode.yields(4, 32) and not decode.yields(32, 32)
    never.before_step()
    assert not never.yields(4, 32)
    never.idle()
    decode.idle()  # as the engine does while it yields
    prefill.between_layers()
    assert prefill.budget == 2
    now[0] += 0.2  # yield_s since its last step began
    assert not decode.yields(4, 32)
    decode.before_step()
    prefill.between_layers()
    assert decode.budget == 1 and prefill.budget == 1
    with pytest.raises(ValueError, match="yield"):
        WorkerCores(share, "decode", 2, wide=2, narrow=1, set_threads=print, yield_s=-1.0)


def test_a_yielding_decode_engine_still_steps_beside_a_prefill_worker_that_never_idles(tmp_path):
    """A prefill worker computes throughout (its claim held by this test): a decode engine with
    yield_s leaves it the cores between steps, yet steps once yield_s after each step began, so its
    stream finishes, with the tokens of an engine that never yields."""
    import asyncio

    from conftest import STORIES_GGUF
    from pdserve.runtime.async_engine import AsyncEngine
    from pdserve.runtime.engine import AddRequest
    from pdserve.runtime.loader import load_checkpoint

    checkpoint = load_checkpoint(STORIES_GGUF)
    ids = checkpoint.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = Engine.from_checkpoint(checkpoint).generate([ids], params)[0].output_ids
    share = CoreShare(tmp_path / "cores")
    cores = WorkerCores(share, "decode", 0, 1, 1, lambda n: None, yield_s=0.02)
    yielded, decides = [0], cores.yields

    def counted(batch: int, capacity: int) -> bool:
        yielded[0] += (answer := decides(batch, capacity))
        return answer
    cores.yields = counted
    stop = threading.Event()

    def prefill_computes() -> None:
        while not stop.is_set():
            share.hold("prefill", 0)
            stop.wait(HOLD_S / 10)
    holder = threading.Thread(target=prefill_computes)
    holder.start()
    aengine = AsyncEngine(Engine.from_checkpoint(checkpoint), batch_window_s=0, cores=cores).start()

    async def tokens() -> list[int]:
        got = []
        async for batch in aengine.generate(AddRequest("r0", ids, params)):
            got += [t for out in batch for t in out.new_token_ids]
        return got
    try:
        got = asyncio.run(asyncio.wait_for(tokens(), 60))
    finally:
        aengine.stop()
        stop.set()
        holder.join()
    assert got == want
    assert yielded[0] > 0


def _toggled_cores(engine: Engine, share: CoreShare, kind: str, every: int) -> WorkerCores:
    """`engine`'s side of `share` as a `kind` worker (2 threads wide, 1 narrow), with the other kind's
    claim toggled every `every` layers of its steps."""
    cores = WorkerCores(share, kind, 0, 2, 1, compute_threads.thread_setter())
    layers = [0]

    def between() -> None:
        layers[0] += 1
        if layers[0] % every == 0:
            share.release(cores.other, 0) if share.busy(cores.other) else share.hold(cores.other, 0)
        cores.between_layers()
    engine.runner.model.between_layers = between
    return cores


def _steps_logits(engine: Engine, batches: list[list[list[int]]], max_tokens: int,
                  cores: WorkerCores | None) -> list[torch.Tensor]:
    """Each step's logits of greedy requests, batch after batch; `cores` told before each step."""
    logits = []
    for b, batch in enumerate(batches):
        for i, ids in enumerate(batch):
            engine.add_request(f"{b}-{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            if cores is not None:
                cores.before_step()
            engine.step()
            logits.append(engine.last_logits.clone())
    return logits


def _one_thread_then_toggled(run: Callable[[bool], object]) -> tuple[object, object]:
    """run(False) and run(True) on a thread of its own that claims one thread (the OpenMP count set
    is the calling thread's), in a worker's process state: torch's process-wide count 1.

    That count is also MKL's, which an op on one OpenMP thread calls outside a parallel region: after
    torch.set_num_threads(2) (as other tests leave it), the fp32 flash attention of a prompt chunk
    after a prefix gave other bits on one claimed thread than on two (SmolLM2's 9 heads, 39 queries
    over 103 keys), and this test failed in such an order. A worker sets 1 before its first op
    (compute_threads.one_thread_by_default), so its MKL calls run on one thread whatever it claims."""
    box = {}

    def body() -> None:
        compute_threads.claim(1)
        box["one"], box["switched"] = run(False), run(True)
    before = torch.get_num_threads()
    compute_threads.one_thread_by_default(1)
    try:
        worker = threading.Thread(target=body)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    return box["one"], box["switched"]


def test_switching_threads_between_steps_and_layers_changes_no_bit(smollm2_bf16, tmp_path):
    """8 sequences (torch's int4 kernel), then 24 (the dense copy): decoded on one thread throughout,
    and with the count switched between 1 and 2 by a prefill claim toggled every few layers."""
    prompts = [smollm2_bf16.tokenizer.encode(f"List {i} animals:") for i in range(24)]

    def decode(toggle: bool) -> list[torch.Tensor]:
        engine = Engine.from_checkpoint(smollm2_bf16, EngineConfig(
            cache=CacheConfig(num_blocks=128, dtype="bfloat16"), dtype="bfloat16", dense_copy=True))
        engine.keep_logits = True
        cores = _toggled_cores(engine, CoreShare(tmp_path / "cores"), "decode", 7) if toggle else None
        logits = _steps_logits(engine, [prompts[:8], prompts[8:]], 4, cores)
        assert cores is None or cores.switches >= 4
        return logits

    one, switched = _one_thread_then_toggled(decode)
    assert len(one) == len(switched)
    for a, b in zip(one, switched):
        assert torch.equal(a, b)


def test_prompts_computed_on_switching_threads_have_the_one_thread_bits(smollm2, tmp_path):
    """A prefill worker's engine (fp32, its dense copy; prompts in chunks of 64 tokens) on one thread
    throughout, and with its count switched between 1 and 2 by a decode claim toggled every few
    layers: the same logits and KV cache."""
    from pdserve.runtime.config import SchedulerConfig

    prompts = [smollm2.tokenizer.encode("Summarize: " + "the tide comes in and goes out. " * n) for n in (2, 9, 20)]

    def prefill(toggle: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        engine = Engine.from_checkpoint(smollm2, EngineConfig(
            cache=CacheConfig(num_blocks=64), dtype="float32", dense_copy=True,
            scheduler=SchedulerConfig(max_num_batched_tokens=64)))
        engine.keep_logits = True
        cores = _toggled_cores(engine, CoreShare(tmp_path / "cores"), "prefill", 5) if toggle else None
        logits = _steps_logits(engine, [prompts], 1, cores)
        assert cores is None or cores.switches >= 4
        return logits, engine.runner.kv_cache.clone()

    (one, kv_one), (switched, kv_switched) = _one_thread_then_toggled(prefill)
    assert len(one) == len(switched) >= 3
    for a, b in zip(one, switched):
        assert torch.equal(a, b)
    assert torch.equal(kv_one, kv_switched)
