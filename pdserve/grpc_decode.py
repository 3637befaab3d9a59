"""Requests whose bytes are not a valid protobuf message get INVALID_ARGUMENT, not UNKNOWN.

grpc.aio parses each request with the method's deserializer before any servicer code runs, and
a DecodeError there ends the call with UNKNOWN ("Unexpected DecodeError ..."), a status clients
cannot act on (found by fuzzing the gateway with random bytes). This server interceptor takes the
parsing over: the method gets the raw bytes, parses them itself, and a parse failure aborts the
call with INVALID_ARGUMENT and a message naming the expected message type.

A streaming handler is either an async generator (pdserve's servicers: `abort_on`) or a coroutine
that writes with `context.write` (grpc.health.v1's Watch, for one). Each is wrapped as what it
is: iterating a coroutine fails the call with UNKNOWN ("'async for' requires an object with
__aiter__"), which broke Watch on every service.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Parse = Callable[[bytes], Any]


async def _parse(parse: Parse, raw: bytes, context: grpc.aio.ServicerContext, method: str) -> Any:
    try:
        return parse(raw)
    except DecodeError as err:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request to {method} is not a valid protobuf message ({err}); "
                            "send the message type the method's proto declares")


async def _parsed_stream(parse: Parse, raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                         method: str) -> AsyncIterator[Any]:
    async for item in raw:
        yield await _parse(parse, item, context, method)


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse, out = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await inner(await _parse(parse, raw, context, method), context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=out)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_unary_stream(handler.unary_stream, parse, method),
                                                    response_serializer=out)
    if handler.stream_unary:
        inner = handler.stream_unary

        async def stream_unary(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            return await inner(_parsed_stream(parse, raw, context, method), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=out)
    return grpc.stream_stream_rpc_method_handler(_stream_stream(handler.stream_stream, parse, method),
                                                 response_serializer=out)


def _unary_stream(inner: Callable[..., Any], parse: Parse, method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(inner):  # writes with context.write: await it, as grpc.aio would
        async def writer(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            await inner(await _parse(parse, raw, context, method), context)
        return writer

    async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in inner(await _parse(parse, raw, context, method), context):
            yield item
    return unary_stream


def _stream_stream(inner: Callable[..., Any], parse: Parse, method: str) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(inner):
        async def writer(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            await inner(_parsed_stream(parse, raw, context, method), context)
        return writer

    async def stream_stream(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in inner(_parsed_stream(parse, raw, context, method), context):
            yield item
    return stream_stream


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Parses requests inside the call so that bad bytes become INVALID_ARGUMENT."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _wrap(handler, handler_call_details.method)
