"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral) and Qwen2/2.5/3, over an attention backend.

One module serves all of them: Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm
on q and k. Parameter names match Hugging Face checkpoints so weights load by name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardBatch
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, d = config.num_heads, config.head_dim
        kvh = config.num_kv_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kvh * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kvh * d, bias=bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = [rotary]  # shared; kept in a list so it is not registered once per layer
        self.spec = AttentionLayerSpec(layer_id, h, kvh, d, d**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        spec = self.spec
        q = self.q_proj(x).view(n, spec.num_heads, spec.head_dim)
        k = self.k_proj(x).view(n, spec.num_kv_heads, spec.head_dim)
        v = self.v_proj(x).view(n, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = batch.attn_backend.forward(q, k, v, spec, batch)  # [n, heads * head_dim]
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, batch)
        return self.norm(x)


class CausalLM(nn.Module):
    """Returns next-token logits `[batch, vocab]` for the last new token of each request, followed by
    the logits of `batch.extra_logit_rows` when an extend pass asks for them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """Re-tie the LM head to the embedding (moving a model with `to_empty` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(input_ids, positions, batch)  # [num_tokens, hidden]
        if not batch.is_decode:
            rows = torch.cumsum(batch.extend_seq_lens, 0) - 1  # [batch]
            if batch.extra_logit_rows is not None:
                rows = torch.cat([rows, batch.extra_logit_rows])  # [batch + num_extra]
            hidden = hidden[rows]
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into parameters by Hugging Face name; all must be present."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            if name not in params:
                raise ValueError(f"checkpoint has unexpected weight {name!r}")
            param = params[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[0]!r}")
