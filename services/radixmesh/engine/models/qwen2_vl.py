"""Qwen2-VL and Qwen2.5-VL: the vision encoder (`qwen2_vl_vision.py`) and a Qwen2 language model with M-RoPE.

M-RoPE (`radixmesh.engine.mm.mrope`) gives each token three position ids; the rotary frequencies
are cut into `mrope_section` bands, each rotated by one of them. EXTEND passes with images take the
three ids per token from `batch.mm`. Everywhere else the three ids are equal, which is plain RoPE at
position + the request's delta: DECODE reads the delta from a per-row table (so decode keeps the
fused rotary kernel and CUDA graphs). Names follow the checkpoints (`visual.*`, `model.*`, `lm_head`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.attention.base import ForwardBatch
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layers import RMSNorm, RotaryEmbedding, _rotate
from radixmesh.engine.models.llama import CausalLM, DecoderLayer
from radixmesh.engine.models.llava import image_embeds
from radixmesh.engine.models.qwen2_vl_vision import Qwen2VisionConfig, Qwen2VisionTransformer
from radixmesh.engine.models.weights import ParamLoader, rename_prefix
from radixmesh.wire.images import ImageInput

_RENAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))
"""Transformers 5 in-memory names -> the published checkpoints' names."""
DEFAULT_MROPE_SECTION = (16, 24, 24)


def mrope_section_of(raw: dict[str, Any], head_dim: int) -> tuple[int, ...]:
    """The rotary bands (time, height, width) in frequencies; they must cover head_dim // 2."""
    text = raw.get("text_config") or {}
    for source in (raw.get("rope_scaling"), text.get("rope_scaling"), text.get("rope_parameters"),
                   raw.get("rope_parameters")):
        if isinstance(source, dict) and source.get("mrope_section"):
            section = tuple(int(s) for s in source["mrope_section"])
            break
    else:
        section = DEFAULT_MROPE_SECTION
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise invalid_argument(f"mrope_section {list(section)} must be three bands adding up to head_dim / 2 = "
                               f"{head_dim // 2}")
    return section


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding that also takes positions `[3, num_tokens]` (M-RoPE); `[num_tokens]` is plain RoPE."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, theta, None)
        band = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(section)])
        self.register_buffer("band", band, persistent=False)  # [head_dim // 2]: which id rotates each frequency
        self.section = section

    def init_buffers(self) -> None:
        super().init_buffers()
        if hasattr(self, "section") and self.get_buffer("cos_cache").device.type != "meta":
            self.band = torch.cat([torch.full((n,), i, dtype=torch.int64, device=self.cos_cache.device)
                                   for i, n in enumerate(self.section)])

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.band.view(1, 1, -1).expand(1, positions.shape[1], -1)  # [1, n, head_dim // 2]
        cos = self.cos_cache[positions].gather(0, index).squeeze(0)  # [n, head_dim // 2]
        sin = self.sin_cache[positions].gather(0, index).squeeze(0)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cos, sin = self._cos_sin(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def forward_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> None:
        if positions.dim() == 1:
            super().forward_store(positions, q, k, v, k_buffer, v_buffer, loc, k_scale, v_scale, qk_norm)
            return
        assert qk_norm is None, "M-RoPE models have no q/k norms"
        from radixmesh.kernels.kv_store import store_kv

        q_rot, k_rot = self.forward(positions, q, k)
        q.copy_(q_rot)
        k.copy_(k_rot)  # k as stored: attention may read the new tokens' k here rather than from the pool
        store_kv(k_buffer, v_buffer, loc, k_rot, v, k_scale, v_scale)  # FP8 pools: through their scales


class Qwen2VLForConditionalGeneration(nn.Module):
    """Same call as `CausalLM` (`forward(input_ids, positions, batch)`), plus `encode_images`."""

    uses_mrope = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        raw = config.raw
        self.config = config
        vision = Qwen2VisionConfig.from_hf_dict(raw["vision_config"], config.hidden_size,
                                                qwen25=config.family == "qwen2_5_vl")
        self.visual = Qwen2VisionTransformer(vision)
        self.language_model = CausalLM(config)
        decoder = self.language_model.model
        decoder.rotary = MRotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          mrope_section_of(raw, config.head_dim))
        for layer in decoder.layers:
            assert isinstance(layer, DecoderLayer), f"a decoder layer of type {type(layer).__name__}"
            layer.self_attn.rotary[0] = decoder.rotary
        self.rope_deltas: torch.Tensor
        self.register_buffer("rope_deltas", torch.zeros(1, dtype=torch.int64), persistent=False)

    def bind_request_rows(self, num_rows: int) -> None:
        """Size the per-row delta table for `num_rows` rows of req_to_token (before CUDA graphs capture)."""
        self.rope_deltas = torch.zeros(num_rows, dtype=torch.int64, device=self.rope_deltas.device)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Merged features `[num_tokens, hidden]` of each image (packed into one encoder call)."""
        weight = self.visual.patch_embed.proj.weight
        patches = torch.cat([torch.from_numpy(image.pixels()) for image in images]).to(weight.device, weight.dtype)
        grids = []
        for image in images:
            assert image.grid_thw is not None, "a Qwen2-VL image without its patch grid"
            grids.append(image.grid_thw)
        features = self.visual(patches, grids)
        return list(features.split([image.num_tokens for image in images]))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mm = batch.mm
        if batch.is_decode:
            rope_positions = positions + self.rope_deltas[batch.req_pool_indices]
        else:
            assert mm is not None and mm.rope_deltas is not None, "an M-RoPE extend pass without its deltas"
            self.rope_deltas[batch.req_pool_indices] = mm.rope_deltas
            rope_positions = mm.mrope_positions if mm.mrope_positions is not None else positions
        embeds = image_embeds(self.language_model, input_ids, batch)
        return self.language_model(input_ids, rope_positions, batch, input_embeds=embeds)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = ParamLoader(self, skip="language_model.")

        def language_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = rename_prefix(name, _RENAMES)
                if name.startswith("visual."):
                    if "rotary_pos_emb" not in name:
                        own.load(name, tensor)
                else:
                    yield name, tensor

        self.language_model.load_weights(language_weights())
        own.check_complete()
