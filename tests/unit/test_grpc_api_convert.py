"""The public gRPC API's messages <-> the HTTP API's models (gateway/grpc_api_convert.py), field by field: unset
options take the HTTP defaults, constraints map to their HTTP fields, and replies carry each choice's new token
ids, log-probs and usage."""

from __future__ import annotations

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.gateway.grpc_api_convert import (
    TokenCursor,
    chat_logprobs,
    chat_request,
    completion_logprobs,
    completion_request,
    model_reply,
    options_fields,
    usage,
)
from radixmesh.gateway.protocol import ChatLogprobs, CompletionLogprobs, ModelObject, Usage
from radixmesh.protocol import inference_pb2 as pb


def test_unset_options_are_left_to_the_http_defaults() -> None:
    assert options_fields(pb.GenerationOptions()) == {}
    fields = options_fields(pb.GenerationOptions(max_tokens=8, temperature=0.0, seed=3, ignore_eos=False))
    assert fields == {"max_tokens": 8, "temperature": 0.0, "seed": 3, "ignore_eos": False}  # set, even at zero


def test_lists_maps_and_counts_are_sent_when_present() -> None:
    options = pb.GenerationOptions(stop=["a", "b"], stop_token_ids=[2], n=2, logit_bias={5: -1.5})
    assert options_fields(options) == {"stop": ["a", "b"], "stop_token_ids": [2], "n": 2, "logit_bias": {"5": -1.5}}


@pytest.mark.parametrize(("options", "expected"), [
    (pb.GenerationOptions(json_object=True), {"response_format": {"type": "json_object"}}),
    (pb.GenerationOptions(json_object=False), {}),
    (pb.GenerationOptions(regex="a+"), {"regex": "a+"}),
    (pb.GenerationOptions(ebnf='root ::= "x"'), {"ebnf": 'root ::= "x"'}),
    (pb.GenerationOptions(json_schema='{"type": "object"}'), {"json_schema": '{"type": "object"}'}),
])
def test_a_constraint_maps_to_its_http_field(options: pb.GenerationOptions, expected: dict[str, object]) -> None:
    assert options_fields(options) == expected


def test_top_logprobs_need_logprobs() -> None:
    with pytest.raises(RadixMeshError) as info:
        options_fields(pb.GenerationOptions(top_logprobs=2))
    assert info.value.param == "top_logprobs"


def test_a_completion_request_takes_text_or_ids_and_streams_with_usage() -> None:
    text = completion_request(pb.CompleteRequest(text="hi", model="m", options=pb.GenerationOptions(max_tokens=4)),
                              stream=False)
    assert (text.prompt, text.model, text.max_tokens, text.stream) == ("hi", "m", 4, False)
    ids = completion_request(pb.CompleteRequest(token_ids=pb.TokenIds(ids=[1, 2]),
                                                options=pb.GenerationOptions(logprobs=True, top_logprobs=2)),
                             stream=True)
    assert ids.prompt == [1, 2] and ids.logprobs == 2 and ids.stream
    assert ids.stream_options is not None and ids.stream_options.include_usage
    with pytest.raises(RadixMeshError) as info:
        completion_request(pb.CompleteRequest(), stream=False)
    assert info.value.param == "prompt"


def test_a_chat_request_carries_its_messages_and_logprob_asks() -> None:
    request = chat_request(pb.ChatRequest(messages=[pb.ChatTurn(role="user", content="hi")],
                                          options=pb.GenerationOptions(logprobs=True, top_logprobs=3)), stream=False)
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]
    assert request.logprobs is True and request.top_logprobs == 3 and request.model is None


def test_usage_and_models_reply_in_grpc_terms() -> None:
    assert usage(None) is None
    value = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)
    value.prompt_tokens_details.cached_tokens = 2
    reply = usage(value)
    assert reply is not None and (reply.prompt_tokens, reply.completion_tokens, reply.total_tokens,
                                  reply.cached_tokens) == (5, 3, 8, 2)
    model = model_reply(ModelObject(id="m", created=7, owned_by="radixmesh", root=None, max_model_len=None))
    assert (model.id, model.created, model.root, model.max_model_len) == ("m", 7, "", 0)


def test_completion_logprobs_become_entries_with_their_alternatives() -> None:
    logprobs = CompletionLogprobs(tokens=["a", "b"], token_logprobs=[-0.5, None], text_offset=[0, 1],
                                  top_logprobs=[{"a": -0.5, "c": -1.0}, None])
    entries = completion_logprobs(logprobs)
    assert [(e.token, e.logprob, e.text_offset) for e in entries] == [("a", -0.5, 0), ("b", 0.0, 1)]
    assert [(t.token, t.logprob) for t in entries[0].top_logprobs] == [("a", -0.5), ("c", -1.0)]
    assert entries[0].token_bytes == b"a" and not entries[1].top_logprobs
    assert completion_logprobs(None) == []


def test_chat_logprobs_keep_their_bytes() -> None:
    content = ChatLogprobs.model_validate({"content": [
        {"token": "é", "logprob": -0.1, "bytes": list("é".encode()), "top_logprobs": [
            {"token": "é", "logprob": -0.1, "bytes": None}]}]})
    (entry,) = chat_logprobs(content)
    assert entry.token_bytes == "é".encode() and entry.top_logprobs[0].token_bytes == "é".encode()
    assert chat_logprobs(None) == [] and chat_logprobs(ChatLogprobs(content=None)) == []


def test_a_token_cursor_hands_out_each_choices_new_ids_once() -> None:
    states = [type("State", (), {"token_ids": [1, 2]})(), type("State", (), {"token_ids": []})()]
    cursor = TokenCursor(states)  # type: ignore[arg-type]
    assert cursor.take(0) == [1, 2] and cursor.take(0) == [] and cursor.take(1) == []
    states[0].token_ids += [3]
    assert cursor.take(0) == [3]
