"""`pdserve generate`: generate text in-process, or as a client of a running gateway.

Only the generated text goes to stdout, streamed as it is produced; errors go to stderr.
"""

from __future__ import annotations

import argparse
import sys

NAME = "generate"
HELP = "generate text for one prompt (in-process engine, or --server HOST:PORT of a gateway)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.engine_args import add_engine_args

    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--server", default=None, help="host:port of a pdserve gateway; default: run in-process")
    add_engine_args(p)


def sampling_from_args(args: argparse.Namespace):
    from pdserve.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                          repetition_penalty=args.repetition_penalty, stop=tuple(args.stop))


def run(args: argparse.Namespace) -> int:
    try:
        params = sampling_from_args(args)
        if args.server:
            return _run_remote(args, params)
        return _run_local(args, params)
    except Exception as exc:  # noqa: BLE001 - one line for a person, not a traceback
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 1


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _run_local(args: argparse.Namespace, params) -> int:
    from pdserve.engine_args import build_engine
    from pdserve.runtime.detokenizer import IncrementalDetokenizer

    engine, checkpoint = build_engine(args)
    tokenizer = checkpoint.tokenizer
    prompt_ids = tokenizer.encode(args.prompt)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
    engine.add_request("generate", prompt_ids, params)
    while engine.has_unfinished() and not detok.stopped:
        for out in engine.step():
            _emit(detok.add(out.new_token_ids))
    engine.abort("generate")
    _emit(detok.finish() + "\n")
    return 0


def _run_remote(args: argparse.Namespace, params) -> int:
    import grpc

    from pdserve.proto_convert import sampling_to_proto
    from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(args.server) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling_to_proto(params))
        try:
            for chunk in stub.Generate(request):
                _emit(chunk.text)
        except grpc.RpcError as err:
            print(f"pdserve generate: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    _emit("\n")
    return 0
