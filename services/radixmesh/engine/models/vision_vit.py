"""CLIP and SigLIP vision towers (ViT): fixed-size images -> one feature row per patch.

Parameter names follow Hugging Face's `CLIPVisionModel` / `SiglipVisionModel` (under `vision_model.`),
so the towers of LLaVA checkpoints load by name. Only the layers up to the one the model reads
features from are run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from radixmesh.common.errors import unsupported


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation of a Hugging Face `hidden_act` name."""
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return nn.functional.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: nn.functional.gelu(x, approximate="tanh")
    if name == "silu":
        return nn.functional.silu
    raise unsupported(f"vision activation {name!r} is not supported")


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a CLIP or SigLIP vision tower (its vision_config)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    has_class_token: bool
    """CLIP: a class token before the patches and a pre-layernorm; SigLIP: neither (and a patch bias)."""

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ViTConfig:
        siglip = "siglip" in str(cfg.get("model_type", ""))
        return cls(int(cfg.get("hidden_size", 1024)), int(cfg.get("intermediate_size", 4096)),
                   int(cfg.get("num_hidden_layers", 24)), int(cfg.get("num_attention_heads", 16)),
                   int(cfg.get("image_size", 336)), int(cfg.get("patch_size", 14)),
                   float(cfg.get("layer_norm_eps", 1e-6 if siglip else 1e-5)),
                   str(cfg.get("hidden_act", "gelu_pytorch_tanh" if siglip else "quick_gelu")), not siglip)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ViTEmbeddings(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, c.hidden_size, c.patch_size, c.patch_size, bias=not c.has_class_token)
        self.class_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.has_class_token else None
        self.position_embedding = nn.Embedding(c.num_patches + int(c.has_class_token), c.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # The patch convolution (kernel = stride = patch) as one GEMM over flattened patches: faster than
        # cuDNN here, and float32 stays exact on CUDA (cuDNN convolutions default to TF32).
        conv = self.patch_embedding
        b, c, h, w = pixels.shape
        p = conv.kernel_size[0]
        patches = pixels.to(conv.weight.dtype).view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = nn.functional.linear(patches.reshape(b, (h // p) * (w // p), c * p * p),  # [B, g * g, D]
                                 conv.weight.view(conv.out_channels, -1), conv.bias)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class ViTAttention(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.num_heads = c.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (proj(x).view(b, s, self.num_heads, -1).transpose(1, 2)  # [B, heads, S, head_dim]
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(sdpa(q, k, v).transpose(1, 2).reshape(b, s, d))


class ViTMLP(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTLayer(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = ViTAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = ViTMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ViTEncoder(nn.Module):
    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(c) for _ in range(c.num_layers))


class VisionTransformer(nn.Module):
    """`vision_model` of CLIPVisionModel / SiglipVisionModel (the pooling head is not built)."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = ViTEmbeddings(c)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if c.has_class_token else None
        self.encoder = ViTEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """Hidden states `[B, S, D]` at the given indices of Hugging Face's `hidden_states` tuple
        (0: the embeddings, i: after layer i, negative from the end); runs only the layers needed."""
        total = self.config.num_layers + 1
        wanted = [i % total for i in layers]
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in wanted]
