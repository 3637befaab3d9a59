"""A cancel landing on any await of a Prefill or Decode leaves no block referenced and no lease live
(issue 15 items 2 and 9), and a worker whose engine failed reports NOT_SERVING.

The sweeps run the real servicers in-process against a real Engine (stories260K) and a real
kvstore server on loopback, and cancel the call exactly at its k-th suspension, for every k until a
call completes before reaching k. After each: the engine's leak check passes with no pinned block,
the kvstore holds no lease (long before its 120 s TTL), and the same prompt then prefills (or
decodes) to the reference tokens. The stack test does the same with real processes and clients
that cancel gRPC calls at random; the fault test fails a real worker's engine on purpose (and a
unit test corrupts the block accounting); a retry arriving during a cancelled run's cleanup runs anew.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import os
import random
import subprocess
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import STORIES_GGUF
from waiting import wait_until
from decode.service import DecodeServicer
from kvstore.client import KVStoreClient
from kvstore.server import serve
from pdserve.commands.up import free_port
from pdserve.healthcheck import check
from pdserve.runtime.async_engine import AsyncEngine, EngineDeadError
from pdserve.runtime.config import CacheConfig, EngineConfig
from pdserve.runtime.engine import AddRequest, Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.soak.invariants import kv_problems, wait_quiet
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker_common import ENGINE_FAULT_ENV, TransferCounters, Worker, put_blocks
from prefill.service import PrefillServicer
from prefill.single_flight import SingleFlight

BS = 16
STORE_ONLY = 4  # leading prompt blocks the kvstore holds (the first LOCAL also in the paged cache)
LOCAL = 2
DECODE_TOKENS = 8
QUIET_S = 15.0  # well under the kvstore's 120 s lease TTL


@pytest.fixture(scope="module")
def checkpoint():
    torch.set_num_threads(1)
    return load_checkpoint(STORIES_GGUF)


@pytest.fixture(scope="module")
def prompt(checkpoint) -> list[int]:
    ids = checkpoint.tokenizer.encode("Once upon a time, there was a little girl named Lily who loved to")
    return (ids * 8)[:6 * BS + 5]  # 6 full blocks and a partial one


@pytest.fixture(scope="module")
def reference(checkpoint, prompt) -> list[int]:
    """Greedy output of one in-process engine: what prefill (its first token) and decode must give."""
    seq = Engine.from_checkpoint(checkpoint).generate(
        [prompt], SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True))[0]
    return seq.output_ids


@types.coroutine
def _cancel_at_suspension(coro, k: int, cancel: Callable[[], None], fired: list[int]):
    """Runs `coro`, calling `cancel()` just before it suspends for the k-th time: the cancellation
    then lands on exactly that await, whatever it is (engine call, kvstore RPC, thread hop)."""
    count, value, error = 0, None, None
    while True:
        try:
            awaited = coro.throw(error) if error is not None else coro.send(value)
        except StopIteration as stop:
            return stop.value
        count += 1
        if count == k:
            fired.append(k)
            cancel()
        try:
            value, error = (yield awaited), None
        except BaseException as exc:  # noqa: BLE001 - thrown in by the task: hand it on
            value, error = None, exc


def _engine(checkpoint) -> Engine:
    return Engine.from_checkpoint(checkpoint, EngineConfig(cache=CacheConfig(num_blocks=64, block_size=BS)))


def _worker(engine: Engine, kv_address: str, name: str) -> Worker:
    aengine = AsyncEngine(engine, batch_window_s=0).start()
    return Worker(name, aengine, KVStoreClient(kv_address, timeout_s=30), engine.kv_format, TransferCounters())


async def _wait_for(condition: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = QUIET_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _value(condition()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def _assert_quiet(worker: Worker, kv: KVStoreClient) -> None:
    """No sequence, stream or pinned block left in the engine, its leak check passes, no lease."""
    async def no_lease() -> bool:
        stats = await kv.stats()
        return stats.num_leases == 0 and stats.num_pinned == 0
    await _wait_for(no_lease, "the kvstore holds no lease")
    assert worker.aengine.failure is None
    await worker.aengine.check_leaks()  # KVLeakError (as EngineDeadError) if off: pins are counted too
    engine = worker.aengine.engine
    assert (engine.seqs, engine.held, len(engine.pins), worker.aengine.num_streams) == ({}, {}, 0, 0)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block is still referenced (pinned)"


def _sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def _seed_store(checkpoint, prompt: list[int], kv_address: str) -> None:
    """The prompt's first STORE_ONLY blocks in the kvstore, unpinned, as another worker left them."""
    engine = _engine(checkpoint)
    engine.add_request("seed", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    while engine.has_unfinished():
        engine.step()
    blocks = engine.export_held("seed")[:STORE_ONLY]
    worker = _worker(engine, kv_address, "seed")
    try:
        await put_blocks(worker, "", blocks)
    finally:
        await worker.kv.close()
        worker.aengine.stop()


async def _prefill_once(checkpoint, prompt, kv_address: str, k: int, fired: list[int]) -> int:
    """One Prefill on a fresh worker whose paged cache holds the first LOCAL blocks, cancelled at
    its k-th suspension; then the checks, and an uncancelled Prefill of the same prompt."""
    engine = _engine(checkpoint)
    engine.generate([prompt[:LOCAL * BS + 1]], SamplingParams(max_tokens=1))  # LOCAL blocks cached
    worker = _worker(engine, kv_address, f"prefill-{k}")
    servicer = PrefillServicer(worker)
    real = servicer._prefill
    handler: asyncio.Task | None = None
    servicer._prefill = lambda request: _cancel_at_suspension(real(request), k, lambda: handler.cancel(), fired)
    request = worker_pb2.PrefillRequest(request_id=f"r{k}", token_ids=prompt, sampling=_sampling(1),
                                        cached_blocks=STORE_ONLY)
    handler = asyncio.ensure_future(servicer.Prefill(request, None))
    try:
        await handler
    except asyncio.CancelledError:
        pass
    try:
        await _wait_for(lambda: not servicer.flights.running(f"r{k}"), "the cancelled run ended")
        await _assert_quiet(worker, worker.kv)
        servicer._prefill = real
        again = await servicer.Prefill(worker_pb2.PrefillRequest(
            request_id=f"again{k}", token_ids=prompt, sampling=_sampling(1), cached_blocks=STORE_ONLY), None)
        await _assert_quiet(worker, worker.kv)
    finally:
        await worker.kv.close()
        worker.aengine.stop()
    return again.first_token


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if inspect.isawaitable(result) else result


def _sweep(run_once: Callable[[int, list[int]], Awaitable[object]], expect: object) -> int:
    """Runs `run_once(k)` for k = 1, 2, ... until a call ends before its k-th suspension."""
    async def scenario() -> int:
        for k in range(1, 400):
            fired: list[int] = []
            assert await run_once(k, fired) == expect, f"cancelled at suspension {k}"
            if not fired:
                return k
        raise AssertionError("the call never completed")
    return asyncio.run(scenario())


def test_prefill_cancelled_at_every_await_leaks_nothing(checkpoint, prompt, reference):
    async def once(k: int, fired: list[int]) -> int:
        server, port = await _store()
        try:
            await _seed_store(checkpoint, prompt, f"127.0.0.1:{port}")
            return await _prefill_once(checkpoint, prompt, f"127.0.0.1:{port}", k, fired)
        finally:
            await server.stop(None)
    # At least: pin, fetch, add, first token, export, put (calls under the lease run shielded, as
    # one suspension each: what a cancel must not interrupt).
    assert _sweep(once, reference[0]) >= 6


async def _store():
    return await serve("127.0.0.1:0", 64 << 20)


async def _decode_once(checkpoint, prompt, kv_address: str, k: int, fired: list[int]) -> list[int]:
    """Prefill (uncancelled) leaves the blocks under the lease; a Decode on a fresh worker is
    cancelled at its k-th suspension; then the checks, and an uncancelled Decode."""
    prefill = _worker(_engine(checkpoint), kv_address, f"prefill-{k}")
    decode = _worker(_engine(checkpoint), kv_address, f"decode-{k}")
    prefiller, decoder = PrefillServicer(prefill), DecodeServicer(decode, write_back=True)
    try:
        request = await _decode_request(prefiller, prompt, f"d{k}")
        task: asyncio.Task | None = None
        task = asyncio.ensure_future(_cancel_at_suspension(_tokens(decoder, request), k, lambda: task.cancel(), fired))
        try:
            await task
        except asyncio.CancelledError:
            pass
        await _assert_quiet(decode, decode.kv)
        tokens = await _tokens(decoder, await _decode_request(prefiller, prompt, f"again{k}"))
        await _assert_quiet(decode, decode.kv)
        await _assert_quiet(prefill, prefill.kv)
    finally:
        for w in (prefill, decode):
            await w.kv.close()
            w.aengine.stop()
    return tokens


async def _decode_request(prefiller: PrefillServicer, prompt: list[int], rid: str) -> worker_pb2.DecodeRequest:
    done = await prefiller.Prefill(worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt,
                                                             sampling=_sampling(DECODE_TOKENS)), None)
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, first_token=done.first_token,
                                    block_hashes=done.block_hashes, sampling=_sampling(DECODE_TOKENS))


async def _tokens(decoder: DecodeServicer, request: worker_pb2.DecodeRequest) -> list[int]:
    tokens = [request.first_token]
    async for chunk in decoder.Decode(request, None):
        tokens.extend(chunk.token_ids)
    return tokens


def test_decode_cancelled_at_every_await_leaks_nothing(checkpoint, prompt, reference):
    async def once(k: int, fired: list[int]) -> list[int]:
        server, port = await _store()
        try:
            return await _decode_once(checkpoint, prompt, f"127.0.0.1:{port}", k, fired)
        finally:
            await server.stop(None)
    assert _sweep(once, reference) > 3


# ---- real processes ------------------------------------------------------------------------------

STORY = "Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog. "
STACK_TOKENS = 24


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 1, "--disagg-policy", "always-remote")  # every prompt meets the prefill worker
    yield s
    s.stop()


def _story(i: int) -> str:
    return f"{STORY * (2 + i % 4)}Story {i % 3}:"  # shared prefixes of 2-5 sentences: cached blocks


def _generate(stack, text: str, cancel: str, delay_s: float) -> list[int]:
    """One streaming Generate, cancelled after its first response ("first"), after `delay_s`
    ("timer"), or not at all (""); the tokens it got."""
    call = stack.gateway_stub().Generate(gateway_pb2.GenerateRequest(
        prompt=text, sampling=_sampling(STACK_TOKENS)), timeout=120)
    timer = threading.Timer(delay_s, call.cancel)
    if cancel == "timer":
        timer.start()
    tokens: list[int] = []
    try:
        for chunk in call:
            tokens.extend(chunk.token_ids)
            if cancel == "first":
                call.cancel()
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.CANCELLED, err
    finally:
        timer.cancel()
    return tokens


def _prefill_direct(stack, checkpoint, i: int, delay_s: float) -> None:
    """A Prefill straight to the worker (its cached prefix pinned, fetched under the lease),
    cancelled after `delay_s`: mid-prefill, or after it ended."""
    ids = checkpoint.tokenizer.encode(_story(i))
    with grpc.insecure_channel(stack.child("prefill-0").spec.address) as channel:
        future = worker_pb2_grpc.PrefillWorkerStub(channel).Prefill.future(worker_pb2.PrefillRequest(
            request_id=f"direct-{i}", token_ids=ids, sampling=_sampling(1), cached_blocks=(len(ids) - 1) // BS),
            timeout=60)
        time.sleep(delay_s)
        future.cancel()
        try:
            future.result()
        except grpc.FutureCancelledError:
            pass


def test_clients_cancelling_at_random_leave_every_block_free(stack, checkpoint):
    rng = random.Random(15)
    jobs = []
    for i in range(48):
        jobs.append((_generate, stack, _story(i), ("first", "timer", "")[i % 3], rng.uniform(0, 0.05)))
        if i % 2:
            jobs.append((_prefill_direct, stack, checkpoint, i, rng.uniform(0, 0.03)))
    with cf.ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(*job) for job in jobs]:
            f.result()
    problems = kv_problems(wait_quiet(stack, timeout_s=QUIET_S))
    assert problems == []  # every worker's free == total, no kvstore lease or pin, well before the TTL
    for child in stack.workers:
        assert check(child.spec.address) == "SERVING", child.spec.name
    ids = checkpoint.tokenizer.encode(_story(5))
    expected = Engine.from_checkpoint(checkpoint).generate(
        [ids], SamplingParams(max_tokens=STACK_TOKENS, temperature=0, ignore_eos=True))[0].output_ids
    assert _generate(stack, _story(5), "", 0) == expected


def test_engine_failure_turns_the_worker_not_serving():
    """An internal error on the engine thread (injected by ENGINE_FAULT_ENV at its 3rd step): the
    worker's health says NOT_SERVING and calls get UNAVAILABLE naming the failure."""
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, ENGINE_FAULT_ENV: "2"}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "prefill", "--bind", address, "--kvstore",
                             f"127.0.0.1:{free_port()}", "--threads", "1", "--model", str(STORIES_GGUF)], env=env)
    try:
        _wait_status(address, "SERVING", 180)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.PrefillWorkerStub(channel)
            for i in range(2):
                _prefill_call(stub, f"ok-{i}")
            with pytest.raises(grpc.RpcError) as failed:
                _prefill_call(stub, "faulted")
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            _wait_status(address, "NOT_SERVING", QUIET_S)
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
                service="pdserve.v1.PrefillWorker"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                _prefill_call(stub, "after")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "engine failed" in refused.value.details() and "NOT_SERVING" in refused.value.details()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _prefill_call(stub, rid: str) -> worker_pb2.PrefillResponse:
    return stub.Prefill(worker_pb2.PrefillRequest(request_id=rid, token_ids=[1, 403, 407, 261],
                                                  sampling=_sampling(1)), timeout=30)


def _wait_status(address: str, status: str, timeout_s: float) -> None:
    assert wait_until(lambda: check(address) == status, timeout_s), \
        f"{address} still {check(address)}, not {status}, after {timeout_s} s"


def test_a_retry_arriving_while_a_cancelled_run_cleans_up_runs_anew():
    """Joining the cancelled run would answer the retry CANCELLED; overlapping it would let the old
    cleanup (lease release with drop) end the new run's lease. So it waits, then runs afresh."""
    async def scenario() -> None:
        flights: SingleFlight[str] = SingleFlight()
        cleaning, may_end = asyncio.Event(), asyncio.Event()

        async def first_run() -> str:
            try:
                await asyncio.Event().wait()
            finally:
                cleaning.set()
                await may_end.wait()  # releases on their way
            return "old"

        async def second_run() -> str:
            return "fresh"
        first = asyncio.ensure_future(flights.run("r", first_run))
        await asyncio.sleep(0)
        first.cancel()  # its only caller left: the run is cancelled and starts cleaning up
        await cleaning.wait()
        second = asyncio.ensure_future(flights.run("r", second_run))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not second.done() and flights.joined == 0
        may_end.set()
        assert await second == "fresh"
        assert first.cancelled() and not flights.running("r")
    asyncio.run(scenario())


def test_corrupt_block_accounting_fails_the_engine(checkpoint):
    """A release more often than referenced (KVLeakError) is not one request's INTERNAL error: the
    engine is failed, its listeners hear it once, and every later call is refused UNAVAILABLE."""
    async def scenario() -> None:
        aengine = AsyncEngine(_engine(checkpoint), batch_window_s=0).start()
        heard: list[str] = []
        aengine.on_failure(heard.append)
        try:
            with pytest.raises(EngineDeadError, match="KVLeakError: block 0 released more often"):
                await aengine._call(lambda e: e.block_manager.release([0]))  # a bug, on purpose
            assert heard == [aengine.failure] and "KVLeakError" in heard[0]
            with pytest.raises(EngineDeadError, match="NOT_SERVING"):
                await anext(aengine.generate(AddRequest("r", [1, 2, 3], SamplingParams())))
            assert aengine.num_streams == 0
        finally:
            aengine.stop()
    asyncio.run(scenario())
