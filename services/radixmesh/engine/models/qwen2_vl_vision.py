"""The Qwen2-VL and Qwen2.5-VL vision encoders: patches of any image size -> merged features, one per
2x2 patches.

Patches (14 px, two identical frames for images) are embedded by a 3D convolution, run through
ViT blocks with 2D rotary positions (height and width frequencies side by side) and attention
within each image, and every `merge x merge` neighbours are merged by an MLP into one token of the
language model's width. Qwen2.5-VL uses RMSNorm and a gated SiLU MLP, and attends within windows of
`window_size` pixels except in its `fullatt_block_indexes` blocks: the patches are reordered window by
window for the blocks and put back in row order after the merger. Names follow the checkpoints' `visual.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from radixmesh.engine.models.layers import RMSNorm
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
    window_merged: int = 0
    """Qwen2.5-VL: attention windows of this many merged tokens per side (0: full attention, Qwen2-VL)."""
    full_attention_blocks: tuple[int, ...] = ()
    """Qwen2.5-VL: blocks that attend over the whole image."""
    intermediate_size: int = 0
    """Qwen2.5-VL: width of the gated MLP (Qwen2-VL: embed_dim * mlp_ratio, ungated)."""

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], text_hidden: int, qwen25: bool = False) -> Qwen2VisionConfig:
        patch, merge = int(cfg.get("patch_size", 14)), int(cfg.get("spatial_merge_size", 2))
        common = (int(cfg.get("num_heads", 16)), float(cfg.get("mlp_ratio", 4)), patch,
                  int(cfg.get("temporal_patch_size", 2)), merge)
        if not qwen25:
            return cls(int(cfg.get("depth", 32)), int(cfg.get("embed_dim", 1280)),
                       int(cfg.get("hidden_size", text_hidden)), *common, str(cfg.get("hidden_act", "quick_gelu")))
        return cls(int(cfg.get("depth", 32)), int(cfg.get("hidden_size", 1280)),
                   int(cfg.get("out_hidden_size", text_hidden)), *common, str(cfg.get("hidden_act", "silu")),
                   int(cfg.get("window_size", 112)) // merge // patch,
                   tuple(int(i) for i in cfg.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   int(cfg.get("intermediate_size", 3420)))

    @property
    def is_windowed(self) -> bool:
        return self.window_merged > 0

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


class PatchEmbed(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.shape = (3, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(3, c.embed_dim, self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # The 3D convolution covers each patch whole: one GEMM over the flattened patches [N, 3 * t * p * p]
        weight = self.proj.weight
        return nn.functional.linear(patches.to(weight.dtype).view(patches.shape[0], -1),
                                    weight.view(weight.shape[0], -1))  # [N, embed]


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


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL: `down(act(gate(x)) * up(x))`, with biases."""

    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.embed_dim, c.intermediate_size)
        self.up_proj = nn.Linear(c.embed_dim, c.intermediate_size)
        self.down_proj = nn.Linear(c.intermediate_size, c.embed_dim)
        self.act = activation(c.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(c: Qwen2VisionConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, 1e-6) if c.is_windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(c, c.embed_dim)
        self.norm2 = _norm(c, c.embed_dim)
        self.attn = VisionAttention(c)
        self.mlp: nn.Module = GatedVisionMLP(c) if c.is_windowed else VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, c: Qwen2VisionConfig) -> None:
        super().__init__()
        self.width = c.embed_dim * c.spatial_merge_size ** 2
        self.ln_q = _norm(c, c.embed_dim)
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
        full = [h * w for t, h, w in grids for _ in range(t)]  # attention over each frame
        if not self.config.is_windowed:
            for block in self.blocks:
                x = block(x, cos, sin, full)
            return self.merger(x)
        order, windows = window_order(grids, self.config.spatial_merge_size, self.config.window_merged)
        order = order.to(x.device)
        x, cos, sin = (_by_unit(t, order, self.config.spatial_merge_size ** 2) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.config.full_attention_blocks else windows)
        return self.merger(x)[torch.argsort(order)]


def _by_unit(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of `x` [N, D] reordered by merge unit (groups of `unit` consecutive rows) as `order` lists them."""
    return x.view(-1, unit, x.shape[-1])[order].view(x.shape)


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL windows: the merge units of every frame listed window by window (`window x window` units,
    row-major inside; windows row-major, the last ones cut at the image's edge), and the patch count of
    each non-empty window."""
    order: list[torch.Tensor] = []
    lens: list[int] = []
    base = 0
    for t, h, w in grids:
        rows, cols = h // merge, w // merge
        units = torch.arange(t * rows * cols).view(t, rows, cols)
        for frame in units:
            for top in range(0, rows, window):
                for left in range(0, cols, window):
                    block = frame[top:top + window, left:left + window].reshape(-1)
                    order.append(block + base)
                    lens.append(block.numel() * merge * merge)
        base += t * rows * cols
    return torch.cat(order), lens
