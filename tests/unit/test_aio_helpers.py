"""asyncio helpers: a deadline that never swallows the caller's cancellation, and task cancellation that
outlasts code which swallows one."""

from __future__ import annotations

import asyncio
import sys

import pytest

from radixmesh.common import aio
from radixmesh.common.env import http_parser
from radixmesh.common.errors import RadixMeshError


def test_a_cancellation_that_meets_the_result_still_cancels() -> None:
    """The race that kept a worker's stats loop alive after shutdown: the answer and the cancellation
    arrive in the same loop iteration."""
    async def run() -> None:
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(aio.wait_for(answer, 10))
        await asyncio.sleep(0)  # the task waits on the answer now
        answer.set_result(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_wait_for_returns_results_and_times_out() -> None:
    async def run() -> None:
        assert await aio.wait_for(asyncio.sleep(0, result="done"), 1) == "done"
        assert await aio.wait_for(asyncio.sleep(0, result="none"), None) == "none"
        with pytest.raises(TimeoutError):
            await aio.wait_for(asyncio.sleep(5), 0.05)

    asyncio.run(run())


def test_cancel_and_wait_ends_a_task_that_swallows_one_cancellation() -> None:
    async def stubborn(swallowed: list[int]) -> None:
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # as a wait_for that returned its result instead would

    async def run() -> None:
        swallowed: list[int] = []
        task = asyncio.create_task(stubborn(swallowed))
        await asyncio.sleep(0)
        await aio.cancel_and_wait(task, None)
        assert task.cancelled() and swallowed == [1]

    asyncio.run(run())


def test_cancel_and_wait_gives_up_on_a_task_that_never_ends() -> None:
    async def deaf(released: asyncio.Event) -> None:
        while not released.is_set():
            try:
                await released.wait()
            except asyncio.CancelledError:
                continue

    async def run() -> None:
        released = asyncio.Event()
        task = asyncio.create_task(deaf(released))
        finished = asyncio.create_task(asyncio.sleep(0))
        await asyncio.sleep(0.01)
        await aio.cancel_and_wait(task, finished, timeout_s=0.3)
        assert not task.done() and finished.done()
        released.set()
        await task

    asyncio.run(run())


async def _loop_kind() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


@pytest.mark.parametrize(("setting", "expected"), [("asyncio", "asyncio"), ("uvloop", "uvloop"), ("", "uvloop")])
def test_run_main_runs_on_the_loop_the_environment_names(monkeypatch: pytest.MonkeyPatch, setting: str,
                                                         expected: str) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.setenv("RADIXMESH_EVENT_LOOP", setting)
    assert aio.run_main(_loop_kind()) == expected


def test_run_main_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it fails
    monkeypatch.setenv("RADIXMESH_EVENT_LOOP", "auto")
    assert aio.run_main(_loop_kind()) == "asyncio"
    monkeypatch.setenv("RADIXMESH_EVENT_LOOP", "uvloop")
    main = _loop_kind()
    with pytest.raises(RadixMeshError, match="uvloop is not installed"):
        aio.run_main(main)
    assert main.cr_frame is None  # closed: never left un-awaited


def test_a_bad_event_loop_or_http_parser_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_EVENT_LOOP", "trio")
    main = _loop_kind()
    with pytest.raises(RadixMeshError, match="RADIXMESH_EVENT_LOOP must be one of auto, uvloop, asyncio"):
        aio.run_main(main)
    assert main.cr_frame is None
    monkeypatch.setenv("RADIXMESH_HTTP_PARSER", "fast")
    with pytest.raises(RadixMeshError, match="RADIXMESH_HTTP_PARSER must be one of"):
        http_parser()


@pytest.mark.parametrize("setting", ["h11", "httptools", ""])
def test_the_http_server_parses_with_the_parser_the_environment_names(monkeypatch: pytest.MonkeyPatch,
                                                                      setting: str) -> None:
    from radixmesh.gateway.config import GatewayConfig
    from radixmesh.gateway.server import http_server

    monkeypatch.setenv("RADIXMESH_HTTP_PARSER", setting)
    server = http_server(lambda *args: None, GatewayConfig(host="127.0.0.1", port=0))
    assert server.config.http == (setting or "auto")
