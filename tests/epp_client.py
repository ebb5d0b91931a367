"""A client of the endpoint picker's ext_proc stream, as a proxy drives it: headers, buffered body, the answer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc.aio
from google.protobuf import struct_pb2

from radixmesh.protocol import ext_proc_pb2 as pb

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DESTINATION = "x-gateway-destination-endpoint"


@dataclass
class Answer:
    """What the picker answered to a request's last message."""

    response: pb.ProcessingResponse
    header: str | None
    """x-gateway-destination-endpoint as set by the header mutation (None: not set)."""
    metadata: str | None
    """envoy.lb / x-gateway-destination-endpoint of the dynamic metadata (None: not set)."""

    @property
    def status(self) -> int:
        """The immediate response's HTTP status (0: none, the request goes on)."""
        if self.response.WhichOneof("response") != "immediate_response":
            return 0
        return int(self.response.immediate_response.status.code)

    def error(self) -> dict[str, Any]:
        return dict(json.loads(self.response.immediate_response.body)["error"])


def headers_message(path: str = "/v1/completions", end_of_stream: bool = False,
                    subset: list[str] | None = None, request_id: str = "") -> pb.ProcessingRequest:
    headers = [(":method", "GET" if end_of_stream else "POST"), (":path", path), ("content-type", "application/json")]
    if request_id:
        headers.append(("x-request-id", request_id))
    message = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]), end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=pb.BUFFERED))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(body: dict[str, Any] | bytes) -> pb.ProcessingRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))


def answer_of(response: pb.ProcessingResponse) -> Answer:
    kind = response.WhichOneof("response")
    header = metadata = None
    if kind in ("request_headers", "request_body"):
        common = getattr(response, kind).response
        for option in common.header_mutation.set_headers:
            if option.header.key == DESTINATION:
                header = option.header.raw_value.decode()
    if "envoy.lb" in response.dynamic_metadata.fields:
        fields = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        if DESTINATION in fields:
            metadata = fields[DESTINATION].string_value
    return Answer(response, header, metadata)


class PickerClient:
    """One channel to a picker; `pick` runs one request's exchange and returns its final answer."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.process = self.channel.stream_stream(PROCESS, request_serializer=pb.ProcessingRequest.SerializeToString,
                                                  response_deserializer=pb.ProcessingResponse.FromString)

    async def pick(self, body: dict[str, Any] | bytes | None, subset: list[str] | None = None,
                   path: str = "/v1/completions", keep_open: bool = False) -> tuple[Answer, Any]:
        """Headers (and the body, unless None); returns the last answer and the call (cancel it when
        `keep_open`, as a proxy ends the stream when its request is done)."""
        call = self.process(timeout=10)
        await call.write(headers_message(path, end_of_stream=body is None, subset=subset))
        first = await call.read()
        if body is None or first.WhichOneof("response") == "immediate_response":
            answer = answer_of(first)
        else:
            assert first.WhichOneof("response") == "request_headers", first
            await call.write(body_message(body))
            answer = answer_of(await call.read())
        if not keep_open:
            await call.done_writing()
        return answer, call

    async def close(self) -> None:
        await self.channel.close()
