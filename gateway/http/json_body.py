"""A request's JSON body: read within the body timeout, parsed, and holding only Unicode text.

JSON's `\\uXXXX` escapes can spell a lone UTF-16 surrogate (`"\\ud800"` without the low half that
would pair it), which Python's json module parses into a str that is not Unicode text: it cannot
be encoded as UTF-8, so the tokenizer (a TypeError), protobuf, a grammar compiler and the logs each
fail on it in their own way (found from outside: a chat message holding one answered 500). Such a
body is refused here, once for every route, with a 400 naming where the surrogate is. The walk
over the parsed body runs only when the raw bytes hold a surrogate escape at all (a regex, no
parse), so ordinary bodies pay nothing for it; a surrogate *pair* parses into one character and
passes.
"""

from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from gateway.http.errors import ApiError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \uD800-\uDFFF, how a surrogate enters JSON text


async def read_json_body(request: web.Request, timeout_s: float) -> object:
    """The parsed body; ApiError 408 when it does not arrive in time, 400 when it is not JSON or
    holds a string that is not Unicode text."""
    try:
        async with asyncio.timeout(timeout_s):  # a client trickling its body must not hold a handler
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s "
                            "(--http-body-timeout-s); send it at once", headers={"Connection": "close"}) from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ApiError(400, "the request body is JSON nested too deeply to parse") from None
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: object) -> None:
    """ApiError 400 naming the first key or string value of `body` that holds a lone surrogate.
    Iterative: the body may nest as deeply as json's decoder allowed."""
    pending: list[tuple[str, object]] = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            _check_text(value, path, path or "the body")
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                _check_text(key, path, f"a key of {path or 'the body'}")
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))


def _check_text(text: str, path: str, what: str) -> None:
    """ApiError 400 when `text` (`what`, at `path` of the body) is not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ApiError(400, f"{what} holds a lone UTF-16 surrogate (\\u{ord(text[err.start]):04x} at character "
                            f"{err.start}), which is not Unicode text: send a surrogate pair, or the character "
                            "itself as UTF-8", param=path or None) from None
