"""An OTLP/gRPC trace receiver on 127.0.0.1 for tests: a real TraceService that keeps every span.

    with OtlpReceiver() as receiver:             # receiver.endpoint == "http://127.0.0.1:PORT"
        ... processes export to it ...
        spans = receiver.wait_for(lambda spans: ..., timeout_s=30)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), name=span.name,
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in span.attributes}, resource=resource))
        self.sink.add(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Collects spans exported over OTLP/gRPC; thread-safe."""

    def __init__(self, port: int = 0) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans += spans
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans so far, once `done(spans)` holds; the spans as they are at the timeout otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(list(self._spans)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return list(self._spans)
