"""The edge's half of image handling: chat content parts -> text with placeholders, images -> pixels,
and each placeholder token -> the image's pad ids (`inputs.image_pad_ids`).

Runs where prompts are tokenized: the tokenizer service, and the front-end process of
`radixmesh serve` and `Engine`. The result (`MultimodalPrompt`) crosses to the worker as typed
messages: protobuf `ImageInput`s between services, `MultimodalInputs` (msgspec) to the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.mm.config import ImageLimits
from radixmesh.engine.mm.loading import load_image
from radixmesh.engine.mm.processors import (
    IMAGE_PROCESSORS,
    ImageProcessor,
    ProcessedImage,
    processor_id_of,
    read_processor_config,
)
from radixmesh.engine.mm.spec import VisionSpec, vision_spec
from radixmesh.engine.model_config import ModelConfig
from radixmesh.wire.images import ImageInput, ImageSource, MultimodalInputs, image_content_hash, image_pad_ids

ChatMessages = list[dict[str, Any]]
"""{"role": ..., "content": str | [{"type": "text", "text": ...} | {"type": "image"}]} per message."""


@dataclass(frozen=True)
class PromptWithImages:
    """A prompt and its images, before tokenization: exactly one of `text`, `messages`, `input_ids`."""

    images: list[ImageSource]
    """In the order of the prompt's placeholders (image parts of messages, image tokens of text or ids)."""
    text: str | None = None
    messages: ChatMessages | None = None
    input_ids: list[int] | None = None
    add_generation_prompt: bool = True
    """For `messages`: open the assistant's turn."""


@dataclass(frozen=True)
class MultimodalPrompt:
    """A tokenized prompt whose image placeholders are expanded, with its preprocessed images."""

    input_ids: list[int]
    mm: MultimodalInputs | None
    """None when the prompt has no image."""
    prompt_text: str = ""
    """The rendered text (chat and text prompts), placeholders unexpanded."""


class MultimodalProcessor:
    """Loads, preprocesses and places the images of prompts for one model."""

    def __init__(self, spec: VisionSpec, processor: ImageProcessor, limits: ImageLimits,
                 tokenizer: Any | None = None) -> None:
        self.spec = spec
        self.processor = processor
        self.limits = limits
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, config: ModelConfig, dirs: Sequence[Path | str | None], tokenizer: Any | None,
                  limits: ImageLimits | None = None) -> MultimodalProcessor | None:
        """The model's processor (config from the first of `dirs` holding one, else the published
        defaults); None for a text-only model."""
        spec = vision_spec(config)
        if spec is None:
            return None
        found = read_processor_config(*(Path(d) for d in dirs if d is not None and Path(d).is_dir()))
        cfg = found if found is not None else spec.default_processor_config
        processor = IMAGE_PROCESSORS[processor_id_of(cfg, spec.processor_id)](cfg, spec.tokens_per_image)
        return cls(spec, processor, limits or ImageLimits(), tokenizer)

    # ---- text ------------------------------------------------------------------------------------
    @property
    def placeholder_text(self) -> str:
        """What one image is in prompt text, e.g. `<image>` or `<|vision_start|><|image_pad|><|vision_end|>`."""
        if self.tokenizer is None:
            raise invalid_argument("this model has no tokenizer; send input_ids with the image token "
                                   f"{self.spec.image_token_id} where each image goes", "messages")
        wrap = self.spec.wrap_token_ids
        ids = [*wrap[:1], self.spec.image_token_id, *wrap[1:2]]
        tokens = [self.tokenizer.convert_ids_to_tokens(t) if t < len(self.tokenizer) else None for t in ids]
        if any(t is None for t in tokens):
            raise invalid_argument(f"the tokenizer has no image token (id {self.spec.image_token_id}); send input_ids "
                                   "with that id where each image goes", "messages")
        return "".join(str(t) for t in tokens)

    def render_messages(self, messages: ChatMessages) -> list[dict[str, str]]:
        """Messages whose content parts are joined into text, each image part as the placeholder."""
        return [{"role": m["role"], "content": self.render_content(m["content"])} for m in messages]

    def render_content(self, content: str | list[dict[str, Any]]) -> str:
        """Text parts joined by newlines; an image part is the placeholder (and the family's separator
        when more content follows it)."""
        if isinstance(content, str):
            return content
        out, after_text = "", False
        for i, part in enumerate(content):
            if part.get("type") == "image":
                out += self.placeholder_text + (self.spec.image_separator if i + 1 < len(content) else "")
                after_text = False
            else:
                out += ("\n" if after_text else "") + str(part.get("text") or "")
                after_text = True
        return out

    # ---- images ----------------------------------------------------------------------------------
    def load(self, sources: Sequence[ImageSource]) -> list[ProcessedImage]:
        """Read and preprocess every image, in order (the request's image count is checked first)."""
        if len(sources) > self.limits.max_images_per_request:
            raise invalid_argument(f"the request has {len(sources)} images; at most "
                                   f"{self.limits.max_images_per_request} are accepted (--max-images-per-request)",
                                   sources[self.limits.max_images_per_request].part)
        return [self._preprocess(source) for source in sources]

    def _preprocess(self, source: ImageSource) -> ProcessedImage:
        try:
            return self.processor.preprocess(load_image(source, self.limits))
        except ValueError as exc:  # numpy / PIL refusing a degenerate image
            raise invalid_argument(f"{source.part}: cannot preprocess the image: {exc}", source.part) from None

    def check_placeholders(self, input_ids: Sequence[int], num_images: int, param: str) -> None:
        """One image token per image, or INVALID_ARGUMENT naming `param` and the placeholder to use."""
        token = self.spec.image_token_id
        count = sum(1 for t in input_ids if t == token)
        if count != num_images:
            where = f"{self.placeholder_text!r} (token {token})" if self.tokenizer is not None else f"token {token}"
            raise invalid_argument(f"the prompt has {count} image placeholder{'s' if count != 1 else ''} {where} "
                                   f"but {num_images} image{'s' if num_images != 1 else ''} "
                                   f"{'were' if num_images != 1 else 'was'} given", param)

    def expand(self, input_ids: Sequence[int], images: Sequence[ProcessedImage],
               param: str = "prompt") -> tuple[list[int], MultimodalInputs | None]:
        """Replace the k-th image token of `input_ids` by the k-th image's pad ids."""
        token = self.spec.image_token_id
        self.check_placeholders(input_ids, len(images), param)
        if not images:
            return list(input_ids), None
        ids: list[int] = []
        placed: list[ImageInput] = []
        pending = iter(images)
        for t in input_ids:
            if t != token:
                ids.append(t)
                continue
            image = next(pending)
            content_hash = image_content_hash(image.pixels, image.grid_thw)
            placed.append(ImageInput(content_hash, len(ids), image.num_tokens, image.pixels.astype("<f4").tobytes(),
                                     tuple(image.pixels.shape), image.grid_thw))
            ids.extend(image_pad_ids(content_hash, image.num_tokens))
        return ids, MultimodalInputs(tuple(placed))

    def prepare_ids(self, input_ids: Sequence[int], sources: Sequence[ImageSource],
                    param: str = "input_ids", text: str = "") -> MultimodalPrompt:
        """Expand a tokenized prompt's placeholders (counted before any image is read)."""
        self.check_placeholders(input_ids, len(sources), param)
        ids, mm = self.expand(input_ids, self.load(sources), param)
        return MultimodalPrompt(ids, mm, text)

    def prepare(self, prompt: PromptWithImages) -> MultimodalPrompt:
        """Tokenize (chat template for messages), then read, preprocess and place the images."""
        from radixmesh.engine.hf_tokenizer import encode_text, render_chat

        if prompt.messages is not None:
            if self.tokenizer is None:
                raise invalid_argument("this model has no tokenizer; send input_ids", "messages")
            text = render_chat(self.tokenizer, self.render_messages(prompt.messages), prompt.add_generation_prompt)
            return self.prepare_ids(encode_text(self.tokenizer, text, False), prompt.images, "messages", text)
        if prompt.text is not None:
            if self.tokenizer is None:
                raise invalid_argument("this model has no tokenizer; send input_ids", "text")
            return self.prepare_ids(encode_text(self.tokenizer, prompt.text), prompt.images, "text", prompt.text)
        return self.prepare_ids(list(prompt.input_ids or []), prompt.images, "input_ids")


def text_only_error(model_name: str, sources: Sequence[ImageSource]) -> Exception:
    """The 400 of an image sent to a model that takes none, naming the first image's part."""
    part = sources[0].part if sources else "messages"
    return invalid_argument(f"{part}: the model {model_name!r} does not take images (it is a text-only model)", part)
