"""Fixtures for the controller tests: a real redis-server, and the state store on each backend."""

from __future__ import annotations

import uuid

import pytest

from controller import open_state_store
from tests.controller.redis_server import NOT_FOUND_HELP, RedisServer, find_redis_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server started for this test session (fails, never skips, without the binary)."""
    binary = find_redis_server()
    if binary is None:
        pytest.fail(NOT_FOUND_HELP, pytrace=False)
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def store_location(request, tmp_path):
    """Where a fresh, empty state store lives: a state directory, or a Redis URL with a key
    prefix no other test uses (so tests share one server without seeing each other)."""
    if request.param == "sqlite":
        state_dir = tmp_path / "state"
        state_dir.mkdir()
        return str(state_dir)
    server = request.getfixturevalue("redis_server")
    return f"{server.url}?prefix=test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_location):
    with open_state_store(store_location) as opened:
        yield opened
