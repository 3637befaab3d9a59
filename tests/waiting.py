"""One way for tests to wait: poll a condition until it holds or a deadline passes (never a sleep
sized for one machine: the deadline is generous, the poll short, so a test holds on a machine 4x
faster or slower)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.05


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0) -> T:
    """The first truthy value of `condition()`, or its last value once `timeout_s` has passed
    (callers assert on it, so a failure shows what was seen)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return value


async def wait_until_async(condition: Callable[[], Awaitable[T]], timeout_s: float = 10.0) -> T:
    """`wait_until` on a running event loop, for a condition that awaits (a store's presence check)."""
    deadline = time.monotonic() + timeout_s
    while not (value := await condition()) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return value
