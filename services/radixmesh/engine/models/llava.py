"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector, and a Llama/Qwen2 language model.

Image positions of a prompt are embedded from the projected vision features (prepared per pass by
`radixmesh.engine.mm.runtime`); everything else is the text model of `models/llama.py`.
Parameter names follow the published llava-hf checkpoints (`vision_tower.vision_model.*`,
`multi_modal_projector.*`, `language_model.model.*`); Transformers 5's in-memory names load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixmesh.engine.attention.base import ForwardBatch
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.llama import CausalLM
from radixmesh.engine.models.vision_vit import VisionTransformer, ViTConfig, activation
from radixmesh.engine.models.weights import ParamLoader, rename_prefix
from radixmesh.wire.images import ImageInput

_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))
"""Transformers 5 in-memory names -> the published checkpoints' names."""
IMAGES_PER_ENCODE = 16
"""Images per vision-tower call (bounds its activation memory)."""


class VisionTower(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(config)


class Projector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    """Same call as `CausalLM` (`forward(input_ids, positions, batch)`), plus `encode_images`."""

    uses_mrope = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw = config.raw
        self.config = config
        vision = ViTConfig.from_hf_dict(raw["vision_config"])
        layer = raw.get("vision_feature_layer", -2)
        self.feature_layers = [int(layer)] if isinstance(layer, int) else [int(i) for i in layer]
        self.drop_class_token = raw.get("vision_feature_select_strategy", "default") == "default"
        self.vision_tower = VisionTower(vision)
        self.multi_modal_projector = Projector(vision.hidden_size * len(self.feature_layers), config.hidden_size,
                                               str(raw.get("projector_hidden_act", "gelu")),
                                               bool(raw.get("multimodal_projector_bias", True)))
        self.language_model = CausalLM(config)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Projected features `[num_tokens, hidden]` of each image, in the model's dtype and device."""
        tower = self.vision_tower.vision_model
        weight = tower.embeddings.patch_embedding.weight
        size = tower.config.image_size
        out: list[torch.Tensor] = []
        for start in range(0, len(images), IMAGES_PER_ENCODE):
            group = images[start:start + IMAGES_PER_ENCODE]
            for image in group:
                assert image.pixel_shape == (3, size, size), (
                    f"image pixels of shape {image.pixel_shape}; the vision tower takes (3, {size}, {size})")
            pixels = torch.stack([torch.from_numpy(image.pixels()) for image in group])
            states = tower.hidden_states(pixels.to(weight.device, weight.dtype), self.feature_layers)
            if self.drop_class_token:
                states = [s[:, 1:] for s in states]
            features = self.multi_modal_projector(torch.cat(states, dim=-1))  # [B, tokens, hidden]
            out.extend(features.unbind(0))
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        embeds = image_embeds(self.language_model, input_ids, batch)
        return self.language_model(input_ids, positions, batch, input_embeds=embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = ParamLoader(self, skip="language_model.")

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = rename_prefix(name, _RENAMES)
                if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                    name = "vision_tower.vision_model." + name[len("vision_tower."):]  # as Transformers 5 saves it
                if name.startswith("language_model."):
                    yield name[len("language_model."):], tensor
                elif not (name.startswith("vision_tower.vision_model.head.") or name.endswith("position_ids")):
                    own.load(name, tensor)

        self.language_model.load_weights(language_weights())
        own.check_complete()


def image_embeds(lm: CausalLM, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
    """EXTEND: token embeddings with image positions (pad ids) taken from `batch.mm`; None in DECODE
    (every id is a sampled token: the text model embeds them itself)."""
    if batch.is_decode:
        return None
    ids = input_ids.masked_fill(input_ids >= lm.config.vocab_size, 0)
    embeds: torch.Tensor = lm.model.embed_tokens(ids)
    mm = batch.mm
    if mm is not None and mm.embed_rows is not None:
        assert mm.embeds is not None, "image rows without their features"
        embeds[mm.embed_rows] = mm.embeds.to(embeds.dtype)
    return embeds
