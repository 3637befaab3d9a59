"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per chunk, `data: [DONE]\\n\\n` last.

Each event is written to the socket as soon as it is made (one HTTP/1.1 chunk per event, no
buffering by aiohttp; `X-Accel-Buffering: no` asks nginx-style proxies not to buffer either).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.http.errors import json_dumps

DONE = b"data: [DONE]\n\n"


def event_bytes(obj: Any) -> bytes:
    """One SSE event carrying `obj` as compact JSON."""
    return b"data: " + json_dumps(obj).encode() + b"\n\n"


class SSEWriter:
    """The response of one streamed request; `prepare` commits to status 200."""

    def __init__(self, request: web.Request, headers: dict[str, str] | None = None) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **(headers or {}),
        })

    async def prepare(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: Any) -> None:
        """Write one event; CancelledError when the client has gone away."""
        await self._write(event_bytes(obj))

    async def done(self) -> web.StreamResponse:
        """Write `data: [DONE]` and end the response."""
        await self._write(DONE)
        await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError:
            # The client left: for the request that is a cancel (as on gRPC, and as aiohttp's
            # handler_cancellation makes it anyway when it notices first), not a server error.
            raise asyncio.CancelledError("the client disconnected") from None
