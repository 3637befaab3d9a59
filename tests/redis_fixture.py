"""A real redis-server for tests (`pdserve.redis_process`): started on a free loopback port,
killable and restartable. Import the fixture into a test module
(`from redis_fixture import redis_server  # noqa: F401`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.redis_process import RedisProcess as RedisServer

__all__ = ["RedisServer", "redis_server", "redis_server_module"]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def redis_server_module() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()
