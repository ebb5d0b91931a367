"""asyncio helpers: a deadline that never swallows the caller's cancellation, and task cancellation that
outlasts code which swallows one."""

from __future__ import annotations

import asyncio

import pytest

from radixmesh.common import aio


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
