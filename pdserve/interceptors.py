"""Building blocks of the access-control interceptors (internal token, gateway API keys).

grpc.aio server interceptors see only the method name and the metadata; to refuse a call they
return a handler of the same kind (unary/stream in and out) that aborts, and to hold something
for the length of a call (a concurrency slot) they wrap the handler's behavior. Both are here
once, and so are the four client interceptor kinds (`client_interceptors_of`, also used by
tracing). `OPEN_METHOD_PREFIXES` are the methods every server leaves open: health checks (load
balancers, `pdserve.healthcheck`) and reflection (service discovery, no data).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
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
    return same_kind(handler, lambda behavior: refuse, lambda behavior: refuse)


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
                async for item in streamed(behavior, request_or_iterator, context):
                    yield item
        return run
    return same_kind(handler, unary, stream)


async def streamed(behavior: Callable[..., Any], request_or_iterator: Any,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    """The responses of a streaming-response behavior: an async generator, or a coroutine that
    writes them itself with context.write() (then nothing is yielded here)."""
    result = behavior(request_or_iterator, context)
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        await result


def same_kind(handler: grpc.RpcMethodHandler, unary: Callable[[Any], Any], stream: Callable[[Any], Any]
              ) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind whose behavior is `unary(behavior)` (unary response) or
    `stream(behavior)` (streaming response)."""
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **kwargs)


ClientIntercept = Callable[[Callable[..., Any], grpc.aio.ClientCallDetails, Any], Awaitable[Any]]


def client_interceptors_of(intercept: ClientIntercept) -> list[Any]:
    """Client interceptors running `intercept(continuation, details, request_or_iterator)` for every
    call: one per call kind, as grpc.aio picks interceptors by the kind they subclass."""
    return [kind(intercept) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


def metadata_adders(key: str, value: str) -> list[Any]:
    """Client interceptors that add `key: value` to every call's metadata."""
    async def add(continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), (key, value))
        details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                             details.credentials, details.wait_for_ready)
        return await continuation(details, request)
    return client_interceptors_of(add)


class _ClientKind:
    def __init__(self, intercept: ClientIntercept) -> None:
        self._intercept = intercept


class _UnaryUnary(_ClientKind, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_ClientKind, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_ClientKind, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_ClientKind, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)
