"""A real redis-server on a free 127.0.0.1 port for tests; skipped when redis-server is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixmesh.index.redis_server import LocalRedis, free_port, redis_server_binary


def start_local_redis(workdir: Path) -> LocalRedis:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (scripts/install.sh test installs it)")
    return LocalRedis(port=free_port(), workdir=workdir).start()


@pytest.fixture(scope="module")
def local_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """One Redis per test module (flush it between tests that need a clean slate)."""
    server = start_local_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[LocalRedis]:
    """A Redis of the test's own, which it may stop and start again (it loses everything: no persistence)."""
    server = start_local_redis(tmp_path / "redis")
    yield server
    server.stop()
