"""The one place where errors become HTTP responses, in OpenAI's error body shape.

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from radixmesh.common.errors import ErrorCode, RadixMeshError

CLIENT_CLOSED_REQUEST = 499
"""Non-standard status (nginx) for a request whose client went away; the client never sees it."""

_HTTP: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    ErrorCode.UNAVAILABLE: (503, "server_error"),
    ErrorCode.ABORTED: (CLIENT_CLOSED_REQUEST, "invalid_request_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
    ErrorCode.DRAINING: (503, "server_error"),
}


def _openai_code(exc: RadixMeshError) -> str:
    # The codes OpenAI clients and SDK users branch on; otherwise our own code name.
    if exc.code is ErrorCode.NOT_FOUND and exc.param == "model":
        return "model_not_found"
    if exc.code is ErrorCode.UNAUTHENTICATED:
        return "invalid_api_key"
    return exc.code.value


def to_http(exc: RadixMeshError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for a domain error."""
    status, kind = _HTTP[exc.code]
    param = None if exc.param is None else _printable(exc.param)
    body = {"error": {"message": _printable(exc.message), "type": kind, "param": param, "code": _openai_code(exc)}}
    return status, body


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (lone surrogates echoed from a request) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(exc: RadixMeshError) -> JSONResponse:
    status, body = to_http(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: RadixMeshError) -> str:
    """The error as a server-sent event, for failures after a stream has started."""
    return f"data: {json.dumps(to_http(exc)[1])}\n\n"


def framework_error_response(status: int, detail: str) -> JSONResponse:
    """An error the web framework raised itself (unknown route, wrong method), status kept as is."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, str(status))
    return JSONResponse({"error": {"message": detail, "type": kind, "param": None, "code": code}},
                        status_code=status)


def request_too_large_response(limit_bytes: int) -> JSONResponse:
    """413 for a request body over the gateway's size limit (the body is not read past the limit)."""
    message = f"the request body is larger than the limit of {limit_bytes} bytes"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": "request_too_large"}}, status_code=413)
