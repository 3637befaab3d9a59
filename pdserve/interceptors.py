"""Building blocks of the access-control interceptors (internal token, gateway API keys).

grpc.aio server interceptors see only the method name and the metadata; to refuse a call they
return a handler of the same kind (unary/stream in and out) that aborts, and to hold something
for the length of a call (a concurrency slot) they wrap the handler's behavior. Both are here
once. `OPEN_METHOD_PREFIXES` are the methods every server leaves open: health checks (load
balancers, `pdserve.healthcheck`) and reflection (service discovery, no data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

Around = Callable[[grpc.aio.ServicerContext], AbstractAsyncContextManager[Any]]


def is_open_method(method: str) -> bool:
    return method.startswith(OPEN_METHOD_PREFIXES)


def metadata_value(metadata: Iterable[Any] | None, key: str) -> str | None:
    """The first string value of `key` in call metadata, None when absent."""
    for item in metadata or ():
        if item[0] == key and isinstance(item[1], str):
            return item[1]
    return None


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends every call with `code` and `message`."""
    async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)
    return _same_kind(handler, lambda behavior: refuse, lambda behavior: refuse)


def wrapped(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """`handler` with its behavior run inside `around(context)` (entered before, left after the call)."""
    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                return await behavior(request_or_iterator, context)
        return run

    def stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def run(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            async with around(context):
                result = behavior(request_or_iterator, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                else:  # a coroutine handler that writes with context.write()
                    await result
        return run
    return _same_kind(handler, unary, stream)


def _same_kind(handler: grpc.RpcMethodHandler, unary: Callable[[Any], Any], stream: Callable[[Any], Any]
               ) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kwargs)


def metadata_adders(key: str, value: str) -> list[Any]:
    """Client interceptors (one per call kind) that add `key: value` to every call's metadata."""
    return [cls(key, value) for cls in (_AddUnaryUnary, _AddUnaryStream, _AddStreamUnary, _AddStreamStream)]


class _MetadataAdder:
    def __init__(self, key: str, value: str) -> None:
        self.item = (key, value)

    async def _add(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                   request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.item)
        details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                             details.credentials, details.wait_for_ready)
        return await continuation(details, request)


class _AddUnaryUnary(_MetadataAdder, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._add(continuation, client_call_details, request)


class _AddUnaryStream(_MetadataAdder, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._add(continuation, client_call_details, request)


class _AddStreamUnary(_MetadataAdder, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._add(continuation, client_call_details, request_iterator)


class _AddStreamStream(_MetadataAdder, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._add(continuation, client_call_details, request_iterator)
