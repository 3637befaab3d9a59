"""Fire-and-forget tasks (hints, lease releases) whose outcome no request waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

# asyncio keeps only weak references to tasks; hold them here until they are done.
_running: set[asyncio.Task] = set()


def spawn(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
    """Run `coro` in the background; the coroutine must handle its own errors."""
    task = asyncio.create_task(coro, name=name)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task
