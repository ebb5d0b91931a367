"""The Qwen2-VL vision encoder: patches of any image size -> merged features, one per 2x2 patches.

Patches (14 px, two identical frames for images) are embedded by a 3D convolution, run through
ViT blocks with 2D rotary positions (height and width frequencies side by side) and full attention
within each image, and every `merge x merge` neighbours are merged by an MLP into one token of the
language model's width. Names follow the checkpoints' `visual.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from radixmesh.engine.models.vision_vit import activation


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """A Qwen2-VL vision_config."""

    depth: int
    embed_dim: int
    out_dim: int
    """Width of the merged tokens (the language model's hidden size)."""
    num_heads: int
    mlp_ratio: float
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    hidden_act: str

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], text_hidden: int) -> Qwen2VisionConfig:
        return cls(int(cfg.get("depth", 32)), int(cfg.get("embed_dim", 1280)), int(cfg.get("hidden_size", text_hidden)),
                   int(cfg.get("num_heads", 16)), float(cfg.get("mlp_ratio", 4)), int(cfg.get("patch_size", 14)),
                   int(cfg.get("temporal_patch_size", 2)), int(cfg.get("spatial_merge_size", 2)),
                   str(cfg.get("hidden_act", "quick_gelu")))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


class PatchEmbed(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.shape = (3, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(3, c.embed_dim, self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)  # [N, 3, t, p, p]
        return self.proj(x).view(x.shape[0], -1)  # [N, embed]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.qkv = nn.Linear(c.embed_dim, 3 * c.embed_dim)
        self.proj = nn.Linear(c.embed_dim, c.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each [N, heads, head_dim]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, head_dim]
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        outs = [sdpa(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
                for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens))]  # attention within each image
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        hidden = int(c.embed_dim * c.mlp_ratio)
        self.fc1 = nn.Linear(c.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, c.embed_dim)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.width = c.embed_dim * c.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(c.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, c.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [N / merge^2, out_dim]


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        self.register_buffer("inv_freq", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Rotary frequencies of one spatial axis ([head_dim // 4]), on the module's device."""
        device = self.get_buffer("inv_freq").device
        if device.type == "meta":
            return
        dim = self.config.head_dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))

    def rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[num_patches, head_dim]` of every patch's (row, column), in the processor's patch order
        (merge blocks of `merge x merge` neighbours, row-major)."""
        m, device = self.config.spatial_merge_size, self.inv_freq.device
        pos = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)
            pos.append(hw.repeat(t, 1))
        freqs = torch.cat(pos).unsqueeze(-1).float() * self.inv_freq  # [N, 2, head_dim // 4]
        freqs = freqs.flatten(1)  # [N, head_dim // 2]: height frequencies, then width frequencies
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Merged features `[sum(t * h * w) / merge^2, out_dim]` of the images' patches `[N, patch_dim]`."""
        x = self.patch_embed(patches)
        cos, sin = self.rotary(grids)
        lens = [h * w for t, h, w in grids for _ in range(t)]  # one attention window per frame
        for block in self.blocks:
            x = block(x, cos, sin, lens)
        return self.merger(x)
