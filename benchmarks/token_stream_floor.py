"""The CPU floor of the stack's token path: what its gRPC hops cost a token before any work of ours.

Usage: python benchmarks/token_stream_floor.py [--streams 32] [--tokens 200] [--step-ms 40]

Three processes, as the stack's token path runs (decode worker -> gateway -> client), with nothing
else in them: a source gives each of `--streams` streams one token every `--step-ms` (a decode
step of that many sequences), a relay forwards each token to the client as the gateway's message
(GenerateResponse), and the client (this process) reads every stream. No engine, detokenizer,
routing or metrics: grpc.aio and asyncio alone. Two layouts of the first hop:
- PerStream: a server stream per request, a DecodeChunk a token (the stack's `Decode` call);
- Multiplexed: one stream for all requests, a DecodeChunk a step holding every stream's token
  (the relay hands each to its client stream): the bound of a multiplexed decode-to-gateway call.
Prints one JSON line, then a table: CPU microseconds a token in each process, and the share of a
core that costs at 1,000 tokens/s. Why this exists: stack / in-process at bench-stack's
decode-heavy default workload is bounded by the CPU its other processes take from the engine's two
cores (README, Benchmarks); this is the part of it no code of ours can remove, short of
sending fewer messages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from pdserve.commands.bench_stack import cpu_seconds  # noqa: E402
from pdserve.ports import free_port  # noqa: E402
from pdserve.v1 import gateway_pb2, worker_pb2  # noqa: E402

SERVICE = "floor.Tokens"
CHUNK, RESPONSE = worker_pb2.DecodeChunk, gateway_pb2.GenerateResponse


async def _serve(port: int, handlers: dict, response_type, ready) -> None:
    """A server of `handlers` (method name -> unary-stream handler) on 127.0.0.1:port."""
    server = grpc.aio.server()
    rpcs = {name: grpc.unary_stream_rpc_method_handler(h, request_deserializer=CHUNK.FromString,
                                                       response_serializer=response_type.SerializeToString)
            for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, rpcs),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _stub(port: int, method: str, response_type):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return channel.unary_stream(f"/{SERVICE}/{method}", request_serializer=CHUNK.SerializeToString,
                                response_deserializer=response_type.FromString)


def source(port: int, args: argparse.Namespace, ready) -> None:
    """Ticks every step: a PerStream call yields its token at each tick, the Multiplexed call every
    stream's tokens in one message."""
    async def main() -> None:
        ticks, ticker = [asyncio.Event()], []

        async def tick() -> None:
            while True:
                await asyncio.sleep(args.step_ms / 1e3)
                ticks.append(asyncio.Event())
                ticks[-2].set()

        def stream(width: int):
            """The handler of a call that yields `width` tokens a message at each tick (grpc.aio takes
            an async generator function per method)."""
            async def handler(request, context):
                if not ticker:  # the clock starts with the first call
                    ticker.append(asyncio.get_running_loop().create_task(tick()))
                for i in range(args.tokens):
                    await ticks[-1].wait()
                    yield CHUNK(token_ids=[i] * width)
            return handler
        await _serve(port, {"PerStream": stream(1), "Multiplexed": stream(args.streams)}, CHUNK, ready)
    asyncio.run(main())


def relay(port: int, upstream: int, args: argparse.Namespace, ready) -> None:
    """Forwards a PerStream call token by token; the one upstream Multiplexed call's tokens go to the
    client streams by position, in the order the client's calls arrived."""
    async def main() -> None:
        per_stream, multiplexed = _stub(upstream, "PerStream", CHUNK), _stub(upstream, "Multiplexed", CHUNK)
        queues: list[asyncio.Queue] = []
        reader = []

        async def demultiplex() -> None:
            async for chunk in multiplexed(CHUNK()):
                for q, token in zip(queues, chunk.token_ids):
                    q.put_nowait(token)
            for q in queues:
                q.put_nowait(None)

        async def forward(request, context):
            async for chunk in per_stream(CHUNK()):
                yield RESPONSE(token_ids=chunk.token_ids)

        async def split(request, context):
            queues.append(q := asyncio.Queue())
            if len(queues) == args.streams:  # every client stream is here: start the one upstream call
                reader.append(asyncio.get_running_loop().create_task(demultiplex()))
            while (token := await q.get()) is not None:
                yield RESPONSE(token_ids=[token])
        await _serve(port, {"PerStream": forward, "Multiplexed": split}, RESPONSE, ready)
    asyncio.run(main())


async def read_all(port: int, args: argparse.Namespace, method: str) -> int:
    call = _stub(port, method, RESPONSE)

    async def one() -> int:
        return sum([len(r.token_ids) async for r in call(CHUNK())])
    return sum(await asyncio.gather(*[one() for _ in range(args.streams)]))


def measure(args: argparse.Namespace, method: str) -> dict:
    ctx = mp.get_context("spawn")  # a fork would copy this process's gRPC state, used by the last run
    ports, ready = [free_port(), free_port()], [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=source, args=(ports[0], args, ready[0]), daemon=True),
             ctx.Process(target=relay, args=(ports[1], ports[0], args, ready[1]), daemon=True)]
    for p, r in zip(procs, ready):
        p.start()
        if not r.wait(60):
            raise RuntimeError(f"the benchmark's {p.name} did not start serving in 60 s")
    pids = {"source": procs[0].pid, "relay": procs[1].pid, "client": os.getpid()}
    before, start = cpu_seconds(pids), time.perf_counter()
    tokens = asyncio.run(read_all(ports[1], args, method))
    seconds, after = time.perf_counter() - start, cpu_seconds(pids)
    for p in procs:
        p.terminate()
        p.join()
    us = {name: round(1e6 * (after[name] - before[name]) / tokens, 1) for name in pids}
    return {"layout": method, "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "cpu_us_per_token": us,
            "total_us_per_token": round(sum(us.values()), 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=200, help="tokens each stream carries")
    p.add_argument("--step-ms", type=float, default=40.0, help="time between a stream's tokens (a decode step)")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    rows = [measure(args, method) for method in ("PerStream", "Multiplexed")]
    print(json.dumps({"streams": args.streams, "step_ms": args.step_ms, "runs": rows}))
    print(f"{'first hop':<13}{'tokens':>8}{'tok/s':>8}{'source':>8}{'relay':>8}{'client':>8}{'total':>8}"
          f"{'cores at 1k tok/s':>19}")
    for r in rows:
        us = r["cpu_us_per_token"]
        print(f"{r['layout']:<13}{r['tokens']:>8}{r['tokens_per_s']:>8.0f}{us['source']:>8.1f}{us['relay']:>8.1f}"
              f"{us['client']:>8.1f}{r['total_us_per_token']:>8.1f}{r['total_us_per_token'] / 1e3:>19.2f}")
    print("(CPU microseconds a token in each process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
