"""Failover of a stream between router replicas: a router that dies or drains mid-stream hands it to another.

The gateway relays a router's stream the way a router relays a worker's (radixmesh.router.migration): each
message goes through a `StreamProgress`, and when the replica's stream breaks (the connection went away) or
ends DRAINING (the replica drained past its --drain-timeout-s), the request is sent to another ready replica
resuming from the tokens the client has; that router routes it to a worker, which continues the sequence.
Errors a router reports itself (a worker failed and the router could not move the stream) are final: the
router already tried. The router in the gateway's own process has no replica to fail over to.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import grpc.aio

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.protocol import worker_pb2
from radixmesh.router.migration import LEG_SEPARATOR, StreamProgress

logger = logging.getLogger(__name__)
MAX_FAILOVERS = 3
"""Most router replicas one stream moves through after its first one."""

OpenStream = Callable[[worker_pb2.GenerateRequest], Awaitable[tuple[Any, Any, Any, str]]]
"""(target, call, first message or EOF, the id it runs under) of a Generate on a ready replica
(GenerateUpstream._open)."""
ReadNext = Callable[[Any, Any], Awaitable[Any]]
"""The call's next message or EOF (GenerateUpstream._read)."""


class StreamBroke(RadixMeshError):
    """A target's stream broke after it started (its transport failed, not the target's own answer)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


def retry_request(request: worker_pb2.GenerateRequest, num_tried: int) -> worker_pb2.GenerateRequest:
    """The request as the next replica gets it after `num_tried` refused it before its first message: under an
    id of its own (`<id>~r<n>`), so that it never meets the earlier try on a worker that still runs it."""
    if not num_tried:
        return request
    retry = worker_pb2.GenerateRequest()
    retry.CopyFrom(request)
    retry.request_id = f"{request.request_id}{LEG_SEPARATOR}r{num_tried}"
    return retry


def may_fail_over(exc: RadixMeshError) -> bool:
    """The replica itself went away or drained: another replica can continue the stream."""
    return isinstance(exc, StreamBroke) or exc.code is ErrorCode.DRAINING


async def relay(request: worker_pb2.GenerateRequest, open_stream: OpenStream, read: ReadNext,
                on_target: Callable[[Any, str], None], can_fail_over: bool) -> AsyncGenerator[Any, None]:
    """The messages of `request`'s stream, over as many replicas as it takes (see the module docstring).
    `on_target(target, leg_id)`: where the stream runs now (for aborts)."""
    progress = StreamProgress(request, leg_tag="g")
    failovers = 0
    broke: RadixMeshError | None = None
    while True:
        try:
            target, call, msg, leg_id = await open_stream(progress.next_request())
        except RadixMeshError as exc:
            if broke is None:
                raise
            raise RadixMeshError(broke.code, f"{broke.message}; no other replica could continue it: "
                                             f"{exc.message}") from None
        on_target(target, leg_id)
        try:
            while msg is not grpc.aio.EOF:
                yield progress.observe(msg)
                msg = await read(target, call)
            return
        except RadixMeshError as exc:
            if not (can_fail_over and may_fail_over(exc) and progress.can_resume() and failovers < MAX_FAILOVERS):
                raise
            failovers += 1
            broke = exc
            logger.info("gateway: %s: %s; continuing through another replica (%d)", request.request_id,
                        exc.message, failovers)
        finally:
            call.cancel()
