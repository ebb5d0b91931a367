"""Images in HTTP requests (gateway/images.py): chat content parts and SGLang's `image_data` turned into prompts
with their image sources, each named by where it sat in the request, and the tokenizer service's request and
reply for such prompts."""

from __future__ import annotations

import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.mm.prompt import PromptWithImages
from radixmesh.gateway.images import (
    chat_with_images,
    has_images,
    native_image_sources,
    tokenize_request,
    tokenized_prompt,
)
from radixmesh.gateway.protocol import ChatMessage, ContentPart, ImageURL
from radixmesh.protocol import multimodal_pb2, tokenizer_pb2
from radixmesh.wire.images import ImageSource

PNG = "data:image/png;base64,iVBORw0KGgo="


def messages() -> list[ChatMessage]:
    return [ChatMessage(role="developer", content="be brief"),
            ChatMessage(role="user", content=[ContentPart(type="text", text="what is"),
                                              ContentPart(type="image_url", image_url=ImageURL(url=PNG)),
                                              ContentPart(type="input_image", image_url="https://x/cat.png")]),
            ChatMessage(role="assistant", content=None)]


def test_only_content_parts_of_an_image_type_count_as_images() -> None:
    assert has_images(messages())
    assert not has_images([ChatMessage(role="user", content="plain"),
                           ChatMessage(role="user", content=[ContentPart(type="text", text="t")])])


def test_chat_parts_keep_their_order_and_images_their_place_in_the_request() -> None:
    out, sources = chat_with_images(messages())
    assert out[0] == {"role": "system", "content": "be brief"}  # developer is system
    assert out[1] == {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"},
                                                  {"type": "image"}]}
    assert out[2] == {"role": "assistant", "content": ""}
    assert sources == [ImageSource("messages[1].content[1].image_url", url=PNG),
                       ImageSource("messages[1].content[2].image_url", url="https://x/cat.png")]


@pytest.mark.parametrize(("part", "code", "param"), [
    (ContentPart(type="text"), ErrorCode.INVALID_ARGUMENT, "messages"),
    (ContentPart(type="image_url"), ErrorCode.INVALID_ARGUMENT, "messages[0].content[0].image_url"),
    (ContentPart(type="image_url", image_url=ImageURL(url="")), ErrorCode.INVALID_ARGUMENT,
     "messages[0].content[0].image_url"),
    (ContentPart(type="audio"), ErrorCode.UNSUPPORTED, "messages"),
])
def test_a_bad_part_is_named_where_it_is(part: ContentPart, code: ErrorCode, param: str) -> None:
    with pytest.raises(RadixMeshError) as info:
        chat_with_images([ChatMessage(role="user", content=[part])])
    assert info.value.code is code and info.value.param == param and "messages[0].content[0]" in info.value.message


def test_an_unknown_role_is_unsupported() -> None:
    with pytest.raises(RadixMeshError) as info:
        chat_with_images([ChatMessage(role="wizard", content="hi")])
    assert info.value.code is ErrorCode.UNSUPPORTED and "messages[0].role 'wizard'" in info.value.message


def test_native_image_data_of_one_prompt_and_of_a_batch() -> None:
    assert native_image_sources(None, 2, batched=True) == [[], []]
    assert native_image_sources(PNG, 1, batched=False) == [[ImageSource("image_data", url=PNG)]]
    assert native_image_sources([PNG, PNG], 1, batched=False) == [[ImageSource("image_data[0]", url=PNG),
                                                                  ImageSource("image_data[1]", url=PNG)]]
    batch = native_image_sources([PNG, None, [PNG]], 3, batched=True)
    assert batch == [[ImageSource("image_data[0]", url=PNG)], [], [ImageSource("image_data[2][0]", url=PNG)]]


@pytest.mark.parametrize(("image_data", "batched", "param"), [
    ([PNG], True, "image_data"),  # one entry for two prompts
    ("not-a-list", True, "image_data"),
    (42, False, "image_data"),
    ([PNG, 7], False, "image_data"),
    ([[], PNG], True, "image_data[0]"),
])
def test_bad_image_data_is_named(image_data: object, batched: bool, param: str) -> None:
    with pytest.raises(RadixMeshError) as info:
        native_image_sources(image_data, 2 if batched else 1, batched)
    assert info.value.param == param


def test_the_tokenizer_request_carries_chat_parts_text_or_ids_with_the_images() -> None:
    sources = [ImageSource("image_data", url=PNG), ImageSource("image_data[1]", data=b"\x89PNG")]
    chat, _ = chat_with_images(messages())
    request = tokenize_request(PromptWithImages(sources, messages=chat, add_generation_prompt=False), 16)
    assert request.block_size == 16 and not request.chat.add_generation_prompt
    assert [m.role for m in request.chat.messages] == ["system", "user", "assistant"]
    assert request.chat.messages[0].content == "be brief"
    parts = request.chat.messages[1].parts
    assert [p.WhichOneof("part") for p in parts] == ["text", "image", "image"] and parts[0].text == "what is"
    assert [i.part for i in request.images] == ["image_data", "image_data[1]"]
    assert request.images[1].data == b"\x89PNG"
    text = tokenize_request(PromptWithImages(sources[:1], text="<image> describe"), 8)
    assert text.text == "<image> describe" and text.WhichOneof("input") == "text"
    ids = tokenize_request(PromptWithImages(sources[:1], input_ids=[1, 2, 3]), 8)
    assert list(ids.token_ids.ids) == [1, 2, 3]


def test_the_tokenizer_reply_becomes_a_prompt_with_its_images() -> None:
    reply = tokenizer_pb2.TokenizeResponse(token_ids=[5, 6, 7], prompt_text="<chat>")
    reply.images.append(multimodal_pb2.ImageInput(content_hash=9, offset=1, num_tokens=2, pixel_values=b"\x00" * 8,
                                                  pixel_shape=[2]))
    prompt = tokenized_prompt(reply)
    assert prompt.input_ids == [5, 6, 7] and prompt.prompt_text == "<chat>"
    assert prompt.mm is not None and [(i.content_hash, i.offset, i.num_tokens) for i in prompt.mm.images] == [(9, 1, 2)]
    assert tokenized_prompt(tokenizer_pb2.TokenizeResponse(token_ids=[1])).mm is None
