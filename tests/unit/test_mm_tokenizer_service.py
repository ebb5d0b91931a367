"""The tokenizer service with images: Tokenize reads, preprocesses and places them (pad ids, block hashes
keyed by the image's content), for chat parts, text and token ids; text-only models refuse images."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.mm.prompt import MultimodalProcessor
from radixmesh.protocol import tokenizer_pb2
from radixmesh.tokenizer_service.service import TokenizerServicer
from radixmesh.wire.convert import image_sources_to_proto, images_from_proto
from radixmesh.wire.images import IMAGE_PAD_BASE, ImageSource, image_pad_ids
from tests import mm_factory as mf

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2-VL directory without weights (the tokenizer service reads none)."""
    path = mf.tokenizer_dir(mf.default_tokenizer_source(), tmp_path_factory.mktemp("mm-tok") / "qwen2_vl")
    ids = mf.token_ids(path)
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": mf.VOCAB_SIZE, "image_token_id": ids["<|image_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
              "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "vision_config": {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 4}}
    (path / "config.json").write_text(json.dumps(config))
    mf.qwen2_vl_image_processor().save_pretrained(str(path))
    return path


def _servicer(model_dir: Path, with_images: bool = True) -> TokenizerServicer:
    prepared = prepare_model(str(model_dir), need_weights=False)
    tokenizer = load_tokenizer(model_dir)
    images = MultimodalProcessor.for_model(prepared.config, [model_dir], tokenizer) if with_images else None
    return TokenizerServicer(tokenizer, prepared.name, 16, str(model_dir), images)


def _tokenize(servicer: TokenizerServicer, request: tokenizer_pb2.TokenizeRequest) -> Any:
    return asyncio.run(servicer.Tokenize.__wrapped__(servicer, request, None))  # type: ignore[attr-defined]


def _chat_request(*pngs: bytes, text: str = "What is it?") -> tokenizer_pb2.TokenizeRequest:
    parts = [tokenizer_pb2.ChatContentPart(image=True) for _ in pngs] + [tokenizer_pb2.ChatContentPart(text=text)]
    chat = tokenizer_pb2.ChatConversation(messages=[tokenizer_pb2.ChatMessage(role="user", parts=parts)])
    sources = [ImageSource(f"messages[0].content[{i}].image_url", url=mf.data_url(p)) for i, p in enumerate(pngs)]
    return tokenizer_pb2.TokenizeRequest(chat=chat, images=image_sources_to_proto(sources))


def test_chat_parts_with_images_are_placed_and_hashed_by_content(model_dir: Path) -> None:
    servicer = _servicer(model_dir)
    first = _tokenize(servicer, _chat_request(mf.image_png(1, 100, 70)))
    again = _tokenize(servicer, _chat_request(mf.image_png(1, 100, 70)))
    other = _tokenize(servicer, _chat_request(mf.image_png(2, 100, 70)))
    mm = images_from_proto(first.images)
    assert mm is not None and len(mm.images) == 1
    image = mm.images[0]
    ids = list(first.token_ids)
    assert ids[image.offset:image.end] == image_pad_ids(image.content_hash, image.num_tokens)
    assert IMAGE in first.prompt_text and sum(t >= IMAGE_PAD_BASE for t in ids) == image.num_tokens == 8
    assert list(again.block_hashes.hashes) == list(first.block_hashes.hashes)
    first_image_block = image.offset // 16
    hashes, other_hashes = list(first.block_hashes.hashes), list(other.block_hashes.hashes)
    assert hashes[:first_image_block] == other_hashes[:first_image_block]
    assert all(a != b for a, b in zip(hashes[first_image_block:], other_hashes[first_image_block:]))


def test_token_ids_and_text_with_placeholders(model_dir: Path) -> None:
    servicer = _servicer(model_dir)
    png = mf.image_png(3, 56, 56)
    sources = image_sources_to_proto([ImageSource("image_data", url=mf.data_url(png))])
    by_text = _tokenize(servicer, tokenizer_pb2.TokenizeRequest(text=f"{IMAGE}Describe.", images=sources))
    plain_ids = servicer.tokenizer.encode(f"{IMAGE}Describe.")
    by_ids = _tokenize(servicer, tokenizer_pb2.TokenizeRequest(token_ids=tokenizer_pb2.TokenIdList(ids=plain_ids),
                                                               images=sources))
    assert list(by_ids.token_ids) == list(by_text.token_ids) and len(by_ids.images) == 1


def test_tokenizer_info_says_the_model_takes_images(model_dir: Path) -> None:
    servicer = _servicer(model_dir)
    info = asyncio.run(servicer.GetTokenizerInfo.__wrapped__(  # type: ignore[attr-defined]
        servicer, tokenizer_pb2.GetTokenizerInfoRequest(), None))
    assert info.accepts_images and info.image_placeholder == IMAGE


def test_text_only_model_and_mismatched_parts_are_refused(model_dir: Path) -> None:
    with pytest.raises(RadixMeshError, match="does not take images") as caught:
        _tokenize(_servicer(model_dir, with_images=False), _chat_request(mf.image_png(1)))
    assert caught.value.param == "messages[0].content[0].image_url"
    request = _chat_request(mf.image_png(1))
    del request.images[:]
    with pytest.raises(RadixMeshError, match="carries no images"):
        _tokenize(_servicer(model_dir), request)
