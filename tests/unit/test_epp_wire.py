"""The endpoint picker's pure parts: prompts of request bodies, ext_proc messages, its config."""

from __future__ import annotations

import json

import pytest
from google.protobuf import struct_pb2

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.protocol import ext_proc_pb2 as pb
from radixmesh.router.epp import wire
from radixmesh.router.epp.config import EppConfig
from radixmesh.router.epp.prompt import prompt_of


def body(data: object) -> bytes:
    return json.dumps(data).encode()


def test_chat_prompts_are_rendered_as_the_gateway_renders_them() -> None:
    prompt = prompt_of(body({"messages": [{"role": "developer", "content": "be brief"},
                                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]},
                                          {"role": "assistant", "content": None}]}))
    assert prompt.kind == "chat"
    assert prompt.messages == (("system", "be brief"), ("user", "a\nb"), ("assistant", ""))


@pytest.mark.parametrize(("data", "kind", "value"), [
    ({"prompt": "hello"}, "text", "hello"),
    ({"prompt": ["first", "second"]}, "text", "first"),
    ({"prompt": [1, 2, 3]}, "ids", (1, 2, 3)),
    ({"prompt": [[4, 5], [6]]}, "ids", (4, 5)),
    ({"text": "native"}, "text", "native"),
    ({"input_ids": [7, 8]}, "ids", (7, 8)),
    ({"input_ids": "not ids"}, "none", None),
    ({"prompt": []}, "none", None),
    ({"prompt": [1, -2]}, "none", None),
    ({"prompt": [True, 1]}, "none", None),
    ({"model": "m"}, "none", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "none", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "none", None),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "none", None),
    ({"messages": []}, "none", None),
    ([1, 2], "none", None),
])
def test_prompts_by_body_shape(data: object, kind: str, value: object) -> None:
    prompt = prompt_of(body(data))
    assert prompt.kind == kind, prompt
    if kind == "text":
        assert prompt.text == value
    elif kind == "ids":
        assert prompt.token_ids == value
    else:
        assert prompt.reason


def test_bodies_that_are_not_json_have_no_prompt() -> None:
    assert prompt_of(b"\xff\xfe").kind == "none" and prompt_of(b"{").kind == "none"


def _with_subset(value: object) -> pb.ProcessingRequest:
    message = pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))
    hint = struct_pb2.Struct()
    hint.update({wire.SUBSET: value})
    message.metadata_context.filter_metadata[wire.SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def test_subset_hint() -> None:
    assert wire.subset_of(pb.ProcessingRequest()) is None
    assert wire.subset_of(_with_subset(["10.0.0.1:8000", "10.0.0.2:8000"])) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert wire.subset_of(_with_subset("10.0.0.1:8000, 10.0.0.3:8000")) == {"10.0.0.1:8000", "10.0.0.3:8000"}
    assert wire.subset_of(_with_subset([])) == frozenset()
    other = pb.ProcessingRequest()
    other.metadata_context.filter_metadata["another"].update({"k": "v"})
    assert wire.subset_of(other) is None


def test_the_pick_sets_the_header_and_the_metadata_to_one_value() -> None:
    for on_headers in (True, False):
        response = wire.picked("10.0.0.1:8000,10.0.0.2:8000", on_headers)
        kind = response.WhichOneof("response")
        assert kind == ("request_headers" if on_headers else "request_body")
        common = getattr(response, kind).response
        [option] = common.header_mutation.set_headers
        assert option.header.key == wire.DESTINATION and option.append_action == wire.OVERWRITE
        metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[wire.DESTINATION].string_value
        assert option.header.raw_value.decode() == metadata == "10.0.0.1:8000,10.0.0.2:8000"


@pytest.mark.parametrize(("code", "status"), [(ErrorCode.UNAVAILABLE, 503), (ErrorCode.RESOURCE_EXHAUSTED, 429)])
def test_immediate_responses_carry_the_status_and_an_openai_error(code: ErrorCode, status: int) -> None:
    response = wire.immediate(RadixMeshError(code, "why"))
    immediate = response.immediate_response
    assert immediate.status.code == status and immediate.details == f"epp_{code.value}"
    assert json.loads(immediate.body)["error"]["message"] == "why"
    assert immediate.headers.set_headers[0].header.raw_value == b"application/json"


def test_headers_are_read_from_raw_values() -> None:
    headers = pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key="X-Request-Id", raw_value=b"abc"), pb.HeaderValue(key=":path", value="/v1/models"),
        pb.HeaderValue(key="x-request-id", raw_value=b"second")]))
    assert wire.headers_of(headers) == {"x-request-id": "abc", ":path": "/v1/models"}


@pytest.mark.parametrize("fields", [{"port": 70000}, {"port": 0, "fallbacks": -1}, {"port": 0, "fallbacks": 17},
                                    {"port": 0, "max_queue_per_worker": -1}, {"port": 0, "tokenize_timeout_s": 0}])
def test_bad_config_is_refused(fields: dict[str, int]) -> None:
    with pytest.raises(RadixMeshError):
        EppConfig(**fields)  # type: ignore[arg-type]


def test_only_unified_workers_serve_http() -> None:
    from radixmesh.worker.config import WorkerConfig

    assert WorkerConfig(http_port=0).http_port == 0
    for fields in ({"role": "decode", "http_port": 8000}, {"http_port": 70000}):
        with pytest.raises(RadixMeshError, match="http_port"):
            WorkerConfig(**fields)  # type: ignore[arg-type]
