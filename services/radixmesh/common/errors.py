"""The one domain error of radixmesh and its codes.

Transports map `ErrorCode` to their own statuses in exactly one place each
(HTTP in the gateway, gRPC in the gRPC helpers). Internal invariants use asserts.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """What went wrong, independent of the transport that reports it."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAUTHENTICATED = "unauthenticated"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    ABORTED = "aborted"
    UNSUPPORTED = "unsupported"
    INTERNAL = "internal"
    DRAINING = "draining"
    """The service is shutting down gracefully: a router or gateway moves the request elsewhere (clients see
    it as unavailable)."""


class RadixMeshError(Exception):
    """A failure that is reported to the caller as one clear line.

    `param` names the offending request field or option, when there is one.
    """

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"RadixMeshError({self.code.value}, {self.message!r}, param={self.param!r})"


def invalid_argument(message: str, param: str | None = None) -> RadixMeshError:
    return RadixMeshError(ErrorCode.INVALID_ARGUMENT, message, param)


def not_found(message: str, param: str | None = None) -> RadixMeshError:
    return RadixMeshError(ErrorCode.NOT_FOUND, message, param)


def unsupported(message: str, param: str | None = None) -> RadixMeshError:
    return RadixMeshError(ErrorCode.UNSUPPORTED, message, param)
