"""ext_proc messages of the endpoint-picker protocol, read and built (radixmesh.protocol.ext_proc_pb2).

In: request headers (keys lower-cased, values in raw_value) and the subset hint, a list of ip:port under the
filter metadata namespace `envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`.
Out: the pick as the `x-gateway-destination-endpoint` header and, with the same value, the dynamic metadata
`envoy.lb` / `x-gateway-destination-endpoint`; or an immediate response (503, 429) with an OpenAI error body.
"""

from __future__ import annotations

import json

from google.protobuf import struct_pb2

from radixmesh.common.errors import RadixMeshError
from radixmesh.gateway.errors import to_http
from radixmesh.protocol import ext_proc_pb2 as pb

DESTINATION = "x-gateway-destination-endpoint"
"""The pick: request header, and key in the response's dynamic metadata."""
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(headers: pb.HttpHeaders) -> dict[str, str]:
    """Request headers by (lower-case) name; the first value of a repeated header."""
    out: dict[str, str] = {}
    for header in headers.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out.setdefault(header.key.lower(), value)
    return out


def subset_of(message: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows, when it sends a subset hint (an empty hint allows none)."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.HasField("string_value"))
    if value.HasField("string_value"):  # a comma-separated list, from proxies that cannot send lists
        return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())
    return frozenset()


def _mutation(destination: str) -> pb.CommonResponse:
    header = pb.HeaderValue(key=DESTINATION, raw_value=destination.encode())
    return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[
        pb.HeaderValueOption(header=header, append_action=OVERWRITE)]), clear_route_cache=True)


def _metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
    return metadata


def picked(destination: str, on_headers: bool) -> pb.ProcessingResponse:
    """The pick, answering the request's headers (a body-less request) or its buffered body."""
    common = _mutation(destination)
    if on_headers:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                     dynamic_metadata=_metadata(destination))
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                 dynamic_metadata=_metadata(destination))


def immediate(exc: RadixMeshError) -> pb.ProcessingResponse:
    """Answer the client now with the error's HTTP status and OpenAI error body."""
    status, body = to_http(exc)
    headers = pb.HeaderMutation(set_headers=[pb.HeaderValueOption(
        header=pb.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=OVERWRITE)])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=pb.HttpStatus(code=status), headers=headers, body=json.dumps(body).encode(),
        details=f"epp_{exc.code.value}"))


CONTINUE = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}
"""Answers that change nothing, by the kind of message they answer."""
