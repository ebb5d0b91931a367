"""The one place where `RadixMeshError` becomes a gRPC status, and a gRPC status becomes one again.

A server reports a domain error as the mapped status code plus, in the trailing metadata
key `radixmesh-error-bin`, a serialized `ErrorDetail` (code, message, param, service), so a
client (the gateway, the router) rebuilds the exact error and maps it to HTTP in its own
one place. Errors from peers that are not radixmesh services map by status code alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import grpc.aio

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.protocol import common_pb2

logger = logging.getLogger(__name__)

ERROR_METADATA_KEY = "radixmesh-error-bin"

_TO_STATUS: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.ABORTED: grpc.StatusCode.ABORTED,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.DRAINING: grpc.StatusCode.UNAVAILABLE,
}

_FROM_STATUS: dict[grpc.StatusCode, ErrorCode] = {
    **{status: code for code, status in _TO_STATUS.items() if code is not ErrorCode.DRAINING},
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.UNAUTHENTICATED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: ErrorCode.ABORTED,
    grpc.StatusCode.UNKNOWN: ErrorCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS: ErrorCode.INTERNAL,
}

_PROTO_CODES: dict[ErrorCode, common_pb2.ErrorCode.ValueType] = {
    code: common_pb2.ErrorCode.Value(f"ERROR_CODE_{code.name}") for code in ErrorCode
}
_FROM_PROTO_CODES = {value: code for code, value in _PROTO_CODES.items()}


def to_grpc_status(exc: RadixMeshError, service: str = "") -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes]]]:
    """(status code, details, trailing metadata) that carry `exc` to a gRPC client."""
    return _TO_STATUS[exc.code], exc.message, ((ERROR_METADATA_KEY, error_detail_bytes(exc, service)),)


def error_detail_bytes(exc: RadixMeshError, service: str = "") -> bytes:
    """`exc` as the serialized `ErrorDetail` a radixmesh service sends (gRPC's trailer, the lane's END frame)."""
    return bytes(common_pb2.ErrorDetail(code=_PROTO_CODES[exc.code], message=exc.message, param=exc.param or "",
                                        service=service).SerializeToString())


def error_from_detail(detail: bytes) -> RadixMeshError:
    """The error a serialized `ErrorDetail` stands for."""
    parsed = common_pb2.ErrorDetail.FromString(detail)
    return RadixMeshError(_FROM_PROTO_CODES.get(parsed.code, ErrorCode.INTERNAL), parsed.message,
                          parsed.param or None)


def from_grpc_status(status: grpc.StatusCode, details: str | None, metadata: Any = None,
                     peer: str = "") -> RadixMeshError:
    """The domain error a failed call stands for (exact when the server was a radixmesh service)."""
    for key, value in metadata or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            return error_from_detail(value)
    code = _FROM_STATUS.get(status, ErrorCode.INTERNAL)
    where = f" ({peer})" if peer else ""
    message = details or status.name.lower()
    if status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"service unavailable{where}: {message}"
    return RadixMeshError(code, message)


def from_rpc_error(exc: grpc.RpcError, peer: str = "") -> RadixMeshError:
    """`from_grpc_status` for an exception raised by a sync or asyncio stub call."""
    call = cast(Any, exc)
    metadata = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    return from_grpc_status(call.code(), call.details(), metadata, peer)


async def abort_with(context: grpc.aio.ServicerContext, exc: RadixMeshError, service: str = "") -> None:
    """End the current RPC with `exc` (raises, as `context.abort` does)."""
    status, details, trailing = to_grpc_status(exc, service)
    context.set_trailing_metadata(trailing)
    await context.abort(status, details)


F = TypeVar("F", bound=Callable[..., Any])


def map_errors(service: str) -> Callable[[F], F]:
    """Decorate an asyncio servicer method (unary or server-streaming) so that a `RadixMeshError`
    ends the call with the mapped status and any other exception with INTERNAL (and a log line)."""

    def wrap(method: F) -> F:
        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in method(self, request, context):
                        yield item
                except Exception as exc:
                    await _fail(context, exc, service, method.__name__)
            return cast(F, stream)

        @functools.wraps(method)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await cast(Callable[..., Awaitable[Any]], method)(self, request, context)
            except Exception as exc:
                await _fail(context, exc, service, method.__name__)
        return cast(F, unary)

    return wrap


async def _fail(context: grpc.aio.ServicerContext, exc: Exception, service: str, method: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # context.abort() was already called
    if not isinstance(exc, RadixMeshError):
        logger.exception("%s.%s failed", service, method)
        exc = RadixMeshError(ErrorCode.INTERNAL, f"{service} {method} failed: {type(exc).__name__}: {exc}")
    await abort_with(context, exc, service)
