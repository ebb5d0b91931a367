"""Graceful drain of a service's streams on SIGTERM, shared by the worker and the router.

On SIGTERM the service reports NOT_SERVING (its health watchers hear it at once), refuses new streams with
DRAINING (a router or gateway sends them elsewhere at once, before their first token), lets the streams it
runs finish within `--drain-timeout-s`, then cuts the rest: each is aborted where it runs and its handler,
seeing the abort, ends the call with DRAINING, so that whoever relays it continues it elsewhere from the
tokens already sent (migration) instead of failing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from radixmesh.common.errors import ErrorCode, RadixMeshError

logger = logging.getLogger(__name__)
POLL_S = 0.05
SETTLE_S = 5.0
"""After cutting, how long the cut streams may take to end (their handlers see the abort and raise)."""


class StreamDrain:
    """The drain state of one service: whether it drains, and which of its streams it cut."""

    def __init__(self, service: str) -> None:
        self.service = service
        """Who drains, as error messages name it (e.g. "worker w1")."""
        self.draining = False
        self._cut: set[str] = set()

    def refuse_new(self) -> None:
        """At the start of a stream: DRAINING while draining (the caller tries elsewhere)."""
        if self.draining:
            raise RadixMeshError(ErrorCode.DRAINING, f"{self.service} is draining; it takes no new request")

    def was_cut(self, stream_id: str) -> bool:
        """The stream's abort came from the drain (its handler ends the call with `cut_error`)."""
        return stream_id in self._cut

    def cut_error(self) -> RadixMeshError:
        return RadixMeshError(ErrorCode.DRAINING, f"{self.service} drained: the stream continues elsewhere")

    async def run(self, active: Callable[[], Collection[str]], abort: Callable[[str], Awaitable[object]],
                  timeout_s: float, settle_s: float = SETTLE_S) -> int:
        """Drain: refuse new streams from now on, wait up to `timeout_s` for `active()` to empty, then cut what
        is left (`abort(id)` each) and wait up to `settle_s` for those to end. Returns how many were cut."""
        self.draining = True
        start = time.monotonic()
        if active():
            logger.warning("%s: draining: %d streams running, up to %g s to finish", self.service,
                           len(active()), timeout_s)
        while active() and time.monotonic() - start < timeout_s:
            await asyncio.sleep(POLL_S)
        left = list(active())
        for stream_id in left:
            self._cut.add(stream_id)
            try:
                await abort(stream_id)
            except RadixMeshError as exc:
                logger.warning("%s: drain could not abort %s: %s", self.service, stream_id, exc.message)
        if left:
            logger.warning("%s: drain cut %d streams after %.1f s (they continue elsewhere)", self.service, len(left),
                           time.monotonic() - start)
        settle_start = time.monotonic()
        while any(s in self._cut for s in active()) and time.monotonic() - settle_start < settle_s:
            await asyncio.sleep(POLL_S)
        return len(left)
