"""Scale-in without loss (issue 22; docs/reliability.md, "Scale-in: draining a worker"): a decode
worker given SIGTERM reports NOT_SERVING, refuses new Decode calls with UNAVAILABLE, lets its
streams finish until its drain deadline, hands the rest over (the gateway resumes them on the
other worker from the written-back KV) and exits. Real processes; every stream is compared with
the in-process engine's greedy run. The signal fires on progress (every stream has tokens), never
after a sleep."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import STORIES_GGUF
from test_decode_death import PROMPTS, Streams, _await_decode_healthy, _running
from waiting import wait_until
from pdserve.cli import build_parser
from pdserve.drain import HANDOVER_S, Drain, HandedOver
from pdserve.grpc_server import ServiceError
from pdserve.ports import free_port
from pdserve.runtime.engine import Engine
from pdserve.runtime.loader import load_checkpoint
from pdserve.runtime.sampling_params import SamplingParams
from pdserve.stack import start_stack
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker_config import DRAIN_TIMEOUT_ENV, WorkerConfig

REPO = Path(__file__).resolve().parents[1]
TOKENS = 200  # per stream: the streams must still be mid-answer when the signal comes
HANDOVER_TOKENS = 120  # per stream when the deadline is 0: handed over at once, so shorter will do
NEW_TOKENS = 24  # the request sent while a worker drains
DRAIN_S = 120.0  # the stack's deadline: far beyond the streams' time, so they finish while draining
STOP_GRACE_S = 5.0  # serve_until_signal's default stop grace, after the drain


@pytest.fixture(scope="module")
def reference():
    """({(prompt, max_tokens): greedy output ids} of the in-process engine, the tokenizer). A shorter
    greedy run (ignore_eos) is the longer one's prefix."""
    torch.set_num_threads(1)  # the stack's processes use the other cores; more threads thrash
    checkpoint = load_checkpoint(STORIES_GGUF)
    ids = [checkpoint.tokenizer.encode(p) for p in PROMPTS]
    seqs = Engine.from_checkpoint(checkpoint).generate(ids, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                           ignore_eos=True))
    return ({(p, n): s.output_ids[:n] for p, s in zip(PROMPTS, seqs) for n in (TOKENS, HANDOVER_TOKENS, NEW_TOKENS)},
            checkpoint.tokenizer)


@pytest.fixture(scope="module")
def stack():
    s = start_stack(1, 2, "--disagg-policy", "always-remote", "--max-batch-size", "64",
                    "--http-port", str(free_port()), env={DRAIN_TIMEOUT_ENV: str(DRAIN_S)})
    yield s
    s.stop()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _direct_decode(address: str, prompt_ids: list[int]) -> grpc.RpcError | None:
    """A Decode straight to a worker (as a gateway that has not probed it yet would send); its error."""
    request = worker_pb2.DecodeRequest(request_id="sent-while-draining", prompt_token_ids=prompt_ids,
                                       local_prefill=True, sampling=common_pb2.SamplingParams(
                                           max_tokens=4, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        try:
            list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(request, timeout=10))
        except grpc.RpcError as err:
            return err
    return None


def _generate(stack, prompt: str, tokens: int) -> list[int]:
    request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
        max_tokens=tokens, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(stack.gateway_address) as ch:
        return [t for chunk in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=60) for t in chunk.token_ids]


def _exit_after_sigterm(stack, name: str, timeout_s: float) -> float:
    """SIGTERM worker `name` (the process, as Kubernetes would); wait for it to exit 0; seconds it took."""
    proc = stack.child(name).proc
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=timeout_s) == 0, f"{name} exited with {proc.returncode}"
    return time.monotonic() - start


def _await_holder(stack, streams: int, timeout_s: float = 60.0) -> str:
    """The first decode worker seen running at least `streams` streams (waited for until `timeout_s`).
    Why not wait until every stream has some tokens, then look: on a fast machine the first streams
    had finished all their tokens by then while the last were still in prefill, and the check saw
    no worker running any (CI, a 2-core AVX2 EPYC: `assert 0 >= 4`)."""
    holder = wait_until(lambda: next((name for name in ("decode-0", "decode-1")
                                      if _running(stack, name) >= streams), None), timeout_s)
    assert holder is not None, f"no decode worker ran {streams} streams within {timeout_s} s"
    return holder


def _log(stack, name: str) -> str:
    child = stack.child(name)
    child.forwarder.join(timeout=5)  # its output read to the end
    return "\n".join(child.tail)


def test_sigterm_drains_streams_refuses_new_ones_and_exits(stack, reference):
    """Every stream of the draining worker finishes there (no handover before the deadline);
    meanwhile it says NOT_SERVING, refuses a Decode with UNAVAILABLE, and a new request goes to
    the other worker; the process exits 0 before its deadline."""
    ref, tokenizer = reference
    _await_decode_healthy(stack, 2)
    streams = Streams(stack, 32, TOKENS)
    victim = _await_holder(stack, 4)  # the victim holds a share of the streams, mid-answer
    address, proc = stack.child(victim).spec.address, stack.child(victim).proc
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING, 30), \
        "the draining worker does not report NOT_SERVING"
    err = _direct_decode(address, tokenizer.encode(PROMPTS[0]))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details(), err
    # Sent while the worker drains: the gateway routes it to the other one (or, if its probe has not
    # seen NOT_SERVING yet, the refusal above makes it resume there).
    assert _generate(stack, PROMPTS[1], NEW_TOKENS) == ref[(PROMPTS[1], NEW_TOKENS)]
    assert proc.wait(timeout=DRAIN_S) == 0
    took = time.monotonic() - start
    streams.finish()
    streams.check(ref)
    assert took < DRAIN_S, f"the worker took {took:.1f} s to exit, past its drain deadline"
    log = _log(stack, victim)
    assert "drained: every call finished" in log, log  # none needed a handover


# -- settings ------------------------------------------------------------------------------------

def test_drain_timeout_setting():
    assert WorkerConfig().drain_timeout_s == 30.0
    args = build_parser().parse_args(["decode", "--drain-timeout-s", "7"])
    assert WorkerConfig.from_args(args, {}).drain_timeout_s == 7.0
    assert WorkerConfig.from_args(build_parser().parse_args(["prefill"]), {DRAIN_TIMEOUT_ENV: "0"}).drain_timeout_s == 0
    with pytest.raises(ValueError, match="--drain-timeout-s"):
        WorkerConfig(drain_timeout_s=-1)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_k8s_grace_period_outlasts_the_drain(kind):
    """The kubelet SIGKILLs a pod terminationGracePeriodSeconds after SIGTERM: the drain, the
    handover and the server's stop must fit in it."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / f"{kind}.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == kind)
    config = WorkerConfig.from_args(build_parser().parse_args(container["args"]), {})
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s + HANDOVER_S + STOP_GRACE_S


# -- the drain itself, in-process ------------------------------------------------------------------

def test_drain_refuses_new_calls_lets_running_ones_finish_and_hands_over_the_rest():
    async def scenario() -> None:
        drain = Drain("decode worker w")
        finish = asyncio.Event()
        cancelled = asyncio.Event()

        async def engine_output() -> str:
            try:
                await finish.wait()
                return "token"
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def call() -> str:
            with drain.call():
                return await drain.unless_handed_over(engine_output())

        finishing = asyncio.ensure_future(call())
        await asyncio.sleep(0)  # running: inside unless_handed_over
        running = asyncio.ensure_future(drain.run(5.0))
        await asyncio.sleep(0)
        with pytest.raises(ServiceError) as refused:
            with drain.call():
                pass
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in str(refused.value)
        finish.set()  # the running call finishes before the deadline: nothing is handed over
        assert await finishing == "token"
        await asyncio.wait_for(running, 5)
        assert drain.handed_over == 0

        finish.clear()
        drain = Drain("decode worker w")
        stuck = asyncio.ensure_future(call())
        await asyncio.sleep(0)
        await asyncio.wait_for(drain.run(0), 5)  # deadline 0: handed over at once
        with pytest.raises(HandedOver) as handed:
            await stuck
        assert handed.value.code == grpc.StatusCode.UNAVAILABLE and cancelled.is_set()
        assert drain.handed_over == 1 and drain.calls == 0
        with pytest.raises(HandedOver):  # a wait that starts after the deadline is not even started
            await drain.unless_handed_over(engine_output())

        async def own_timeout() -> None:
            raise TimeoutError("the call's own")
        with pytest.raises(TimeoutError, match="the call's own"):
            await Drain("w").unless_handed_over(own_timeout())
    asyncio.run(scenario())
