"""asyncio helpers that never lose a cancellation.

On Python 3.11, `asyncio.wait_for` returns the inner result when the task is cancelled in the same
loop iteration as the inner future completes: the cancellation is swallowed. A polling loop that
does so (a worker's engine-stats refresh answered just as shutdown cancelled it) then runs on, and
whoever awaits its end waits forever (a worker that never exited after SIGTERM). Use `wait_for`
here instead, and `cancel_and_wait` to stop background tasks. `run_main` runs a service's main coroutine on
its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from radixmesh.common.env import event_loop
from radixmesh.common.errors import invalid_argument

T = TypeVar("T")

CANCEL_RETRY_S = 0.05
"""How long a cancelled task may take to end before it is cancelled again."""


async def wait_for(aw: Awaitable[T], timeout_s: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout_s` (None: no limit); a cancellation of the caller
    always propagates, even when `aw` completes at the same moment."""
    if timeout_s is None:
        return await aw
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await asyncio.wait_for(aw, timeout_s)  # 3.10: its wait_for cannot drop a cancellation this way


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None, timeout_s: float = 10.0) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again any that swallowed a cancellation;
    their results and errors are discarded. After `timeout_s` the ones still running are left behind."""
    pending = {task for task in tasks if task is not None and not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending and loop.time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)
    for ended in tasks:
        if ended is not None and ended.done() and not ended.cancelled():
            with contextlib.suppress(Exception):
                ended.result()


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's `main` to its end on a new event loop: uvloop's when installed (its loop costs less per
    callback and per socket operation than the standard library's), unless RADIXMESH_EVENT_LOOP says otherwise.
    A setting that cannot be honoured raises INVALID_ARGUMENT with `main` closed, never run."""
    try:
        runner = _runner(event_loop())
    except BaseException:
        main.close()
        raise
    return runner(main)


def _runner(choice: str) -> Callable[[Coroutine[Any, Any, T]], T]:
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise invalid_argument("RADIXMESH_EVENT_LOOP=uvloop, but uvloop is not installed",
                                   "RADIXMESH_EVENT_LOOP") from None
        return asyncio.run
    return uvloop.run
