"""A `Backend` for any OpenAI-compatible server's streaming /v1/completions, or /v1/chat/completions
(the prompt as one user message, as a chat front end sends it): llama.cpp server, vLLM, SGLang, or
pdserve's own HTTP API; so the same workload measures pdserve beside what a user runs now.

Each request asks for `ignore_eos` (llama.cpp, vLLM and pdserve take it), so output lengths are the
workload's, and is greedy (`temperature` 0) unless the run samples (`pdserve.bench.sampling`).
Tokens are counted one per streamed chunk that carries text (llama.cpp and vLLM send one token a
chunk), and the final usage (`stream_options.include_usage`), when the server sends it, replaces the
total: a server that coalesces tokens, or splits one token's text over chunks, is still counted
exactly, its ITL then per chunk, as vLLM's benchmark counts it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp

from pdserve.bench.client import Chunk
from pdserve.bench.sampling import RequestSampling


class OpenAIHTTPError(RuntimeError):
    """The server answered with an HTTP error; `status` is its code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class OpenAICompletions:
    def __init__(self, base_url: str, model: str = "", timeout_s: float = 300.0, api_key: str = "",
                 sampling: RequestSampling = RequestSampling(), chat: bool = False) -> None:
        self.url = base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.model = model
        self.sampling = sampling
        self.chat = chat
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made inside the running loop, as aiohttp wants
            # A connection per request: servers close idle keep-alive connections at will (llama.cpp
            # server does), and a request sent on one they just closed fails for no fault of theirs.
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers,
                                                  connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def served_model(self) -> str:
        """The first model id of GET /v1/models (what to send when none was given)."""
        async with self._client().get(f"{self.url}/models") as reply:
            await _raise_for_status(reply)
            models = (await reply.json()).get("data") or []
        if not models:
            raise OpenAIHTTPError(reply.status, f"{self.url}/models lists no model: pass --openai-model")
        return models[0]["id"]

    async def stream(self, prompt: str, max_tokens: int, session_id: str, request_id: str) -> AsyncIterator[Chunk]:
        if not self.model:
            self.model = await self.served_model()
        body = {"model": self.model, "max_tokens": max_tokens, **self.sampling.fields(request_id),
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "chat/completions" if self.chat else "completions"
        counted = 0
        async with self._client().post(f"{self.url}/{path}", json=body) as reply:
            await _raise_for_status(reply)
            async for event in _sse_events(reply):
                choices, usage = event.get("choices") or [], event.get("usage")
                text = _text(choices[0]) if choices else ""
                if text:
                    counted += 1
                    yield Chunk(1, text)
                if usage:  # the server's own count, over or under ours (a token's text may span chunks)
                    yield Chunk(0, "", usage.get("prompt_tokens"),
                                completion_tokens=int(usage.get("completion_tokens", counted)))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _text(choice: dict) -> str:
    """A streamed choice's text: a completion's `text`, a chat completion's `delta.content`."""
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


async def _sse_events(reply: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """The JSON payloads of a server-sent event stream, until `data: [DONE]`."""
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def _raise_for_status(reply: aiohttp.ClientResponse) -> None:
    if reply.status >= 400:
        text = (await reply.text())[:500]
        raise OpenAIHTTPError(reply.status, f"HTTP {reply.status} from {reply.url}: {text}")
