"""The worker front end's checks of a prompt with images, before it reaches the scheduler process
(a malformed image must be one request's 400, never an assertion in the scheduler loop)."""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.common.errors import invalid_argument, unsupported
from radixmesh.engine.mm.spec import VisionSpec, vision_spec
from radixmesh.engine.model_config import ModelConfig
from radixmesh.wire.images import ImageInput, MultimodalInputs, check_image_spans
from radixmesh.wire.sampling import SamplingParams


def validate_images(input_ids: Sequence[int], mm: MultimodalInputs, params: SamplingParams,
                    config: ModelConfig) -> None:
    """INVALID_ARGUMENT (naming `images`) unless every image fits the model and sits where its pad ids are."""
    spec = vision_spec(config)
    if spec is None:
        raise invalid_argument(f"the model ({config.architecture}) does not take images (it is a text-only model)",
                               "images")
    if params.logprob_start_len >= 0:
        raise unsupported("prompt log-probs (logprob_start_len) are not supported for prompts with images",
                          "logprob_start_len")
    for i, image in enumerate(mm.images):
        _check_shape(i, image, spec, config)
    check_image_spans(input_ids, mm, config.vocab_size)


def _check_shape(i: int, image: ImageInput, spec: VisionSpec, config: ModelConfig) -> None:
    vision = config.raw.get("vision_config") or {}
    if spec.tokens_per_image:
        size = int(vision.get("image_size", 336))
        expected: tuple[int, ...] = (3, size, size)
        tokens = spec.tokens_per_image
    else:
        if image.grid_thw is None or len(image.grid_thw) != 3 or min(image.grid_thw) < 1:
            raise invalid_argument(f"images[{i}]: a patch grid (t, h, w) is needed for this model", "images")
        t, h, w = image.grid_thw
        merge, patch = int(vision.get("spatial_merge_size", 2)), int(vision.get("patch_size", 14))
        temporal = int(vision.get("temporal_patch_size", 2))
        if h % merge or w % merge:
            raise invalid_argument(f"images[{i}]: grid {list(image.grid_thw)} is not a multiple of the spatial "
                                   f"merge size {merge}", "images")
        expected = (t * h * w, 3 * temporal * patch * patch)
        tokens = t * h * w // merge ** 2
    if tuple(image.pixel_shape) != expected or image.num_tokens != tokens:
        raise invalid_argument(f"images[{i}]: pixels of shape {list(image.pixel_shape)} for {image.num_tokens} "
                               f"tokens; this model takes shape {list(expected)} for {tokens} tokens", "images")
