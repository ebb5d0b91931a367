"""Llama-family decoder (Llama 2/3.x, SmolLM2, Mistral) and Qwen2/2.5/3, over an attention backend.

One module serves all of them: Qwen2 adds q/k/v biases, Qwen3 adds per-head RMSNorm
on q and k. Parameter names match Hugging Face checkpoints so weights load by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from radixmesh.engine.attention.base import AttentionLayerSpec, ForwardBatch
from radixmesh.engine.distributed.dp_attention import DpAttention
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.sharding import TP_NONE, TensorParallel, WeightSource, take_shard
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.attn_block_runtime import AttnBlockRuntime
from radixmesh.engine.models.layers import AddRMSNorm, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from radixmesh.engine.models.parallel import ParallelLMHead, VocabParallelEmbedding, row_parallel_linear
from radixmesh.kernels.decode_rope import DecodeRope

# checkpoint projection -> (stacked parameter, shard index): q/k/v and gate/up are one GEMM each
STACKED_PARAMS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel = TP_NONE) -> None:
        super().__init__()
        tp = tp.attention_tp  # (whole on every rank under data-parallel attention)
        layout = ShardLayout.of(config, tp.rank, tp.size)
        h, d = layout.num_heads, config.head_dim  # this rank's heads (all of them without TP)
        kvh = layout.num_kv_heads
        # q, k and v projections stacked in one weight (one GEMM); checkpoints load by shard
        self.qkv_proj = Linear(config.hidden_size, (h + 2 * kvh) * d, bias=config.attention_bias)
        self.o_proj = row_parallel_linear(h * d, config.hidden_size, tp)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = [rotary]  # shared; kept in a list so it is not registered once per layer
        self.spec = AttentionLayerSpec(layer_id, h, kvh, d, d**-0.5)
        self.fuse_decode_rope = True
        """Decode passes may hand raw q/k/v to `forward_decode_rope` (draft heads whose passes are not plain
        decode steps turn it off)."""
        self.block: AttnBlockRuntime | None = None
        """Set by the model (RADIXMESH_ATTN_BLOCK): a one-token decode pass may run this layer's whole attention
        half in one kernel (`whole_block`)."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                prologue: AddRMSNorm | None = None) -> torch.Tensor:
        """Attention over `x` (over `prologue(x)` with one: the input norm, fused into the q/k/v GEMV at batch 1)."""
        n = x.shape[0]
        if n == 0:  # a data-parallel attention rank without requests this pass (its MLPs still join the others')
            if prologue is not None:
                prologue.apply(x)
            return x.new_zeros(0, x.shape[-1])
        if prologue is not None and n == 1 and self.block is not None:
            out = self.whole_block(positions, x, batch, prologue)
            if out is not None:
                return out
        spec = self.spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        qkv = self._qkv_rope_store(positions, x, batch, prologue) if prologue is not None and n == 1 else None
        stored = qkv is not None  # q and k rotated and k/v in the pool by the projection's kernel
        if qkv is None:
            qkv = self.qkv_proj(x, prologue)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, spec.num_heads, spec.head_dim)
        k = k.view(n, spec.num_kv_heads, spec.head_dim)
        v = v.view(n, spec.num_kv_heads, spec.head_dim)
        if stored:
            return self.o_proj(batch.attn_backend.forward(q, k, v, spec, batch, save_kv=False))
        return self.o_proj(self._rope_attend(positions, q, k, v, batch))  # [n, hidden]

    def whole_block(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                    prologue: AddRMSNorm) -> torch.Tensor | None:
        """One decode token's input norm, q/k/v, (Qwen3: q/k norms,) rotary, KV store, attention and o projection
        in one persistent kernel (`radixmesh.kernels.attn_block`) where the layer is one it runs (16-bit weights
        without bias, LoRA or TP, a pool in the activations' dtype, the plain rotary, a backend that hands over its
        decode plan); None elsewhere. Sets `prologue.summed` as the norm would."""
        assert self.block is not None
        spec, rotary, o_proj = self.spec, self.rotary[0], self.o_proj
        if not (batch.is_decode and type(rotary) is RotaryEmbedding and type(o_proj) is Linear
                and o_proj.quant_method is None and o_proj.bias is None
                and all(p.lora is None or not p.lora.active for p in (o_proj, self.qkv_proj))
                and self.qkv_proj.bias is None
                and (self.q_norm is None) == (self.k_norm is None)
                and (self.q_norm is None or self.k_norm is None or self.q_norm.eps == self.k_norm.eps)
                and prologue.residual.is_contiguous()):
            return None
        weights = self.qkv_proj.gemv_weights(x)
        ranges = batch.attn_backend.decode_kv_ranges(batch)
        if weights is None or weights[1] is not None or ranges is None:
            return None
        from radixmesh.kernels.attn_block import BlockRope, attn_block_decode, attn_block_supported

        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(spec.layer_id)
        if pool.scales(spec.layer_id) != (1.0, 1.0) or not attn_block_supported(
                x, weights[0], o_proj.weight, k_buf, spec.num_heads, spec.num_kv_heads, spec.head_dim):
            return None
        rope = BlockRope(None if self.q_norm is None else self.q_norm.weight,
                         None if self.k_norm is None else self.k_norm.weight,
                         self.q_norm.eps if self.q_norm is not None else 0.0, rotary.cos_cache, rotary.sin_cache,
                         positions, batch.out_cache_loc)
        ws = self.block.workspace(spec.num_heads, spec.num_kv_heads, spec.head_dim, x.dtype, x.device)
        out, prologue.summed = attn_block_decode(
            x, prologue.residual, prologue.norm.weight, prologue.norm.eps, weights[0], o_proj.weight, rope, k_buf,
            v_buf, *ranges, spec.scaling, ws, config=self.block.config)
        return out

    def _rope_attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     batch: ForwardBatch) -> torch.Tensor:
        """(Qwen3: the q/k norms,) rotary, the KV store and attention over raw q, k, v `[n, heads, head_dim]`;
        returns `[n, heads * head_dim]`."""
        spec = self.spec
        norms = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        rotary = self.rotary[0]
        if not rotary.can_store_kv(q):
            if norms is not None:
                q, k = norms[0](q), norms[1](k)
            q, k = rotary(positions, q, k)
            return batch.attn_backend.forward(q, k, v, spec, batch)
        if norms is not None and self._may_fuse_decode_rope(batch):  # all of it in the attention kernel
            rope = DecodeRope(k, v, norms[0].weight, norms[1].weight, norms[0].eps, rotary.cos_cache, rotary.sin_cache,
                              positions, batch.out_cache_loc)
            return batch.attn_backend.forward_decode_rope(q, spec, batch, rope)
        # the q/k norms (Qwen3), rotary and the KV store in one launch
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(spec.layer_id)
        rotary.forward_store(positions, q, k, v, k_buf, v_buf, batch.out_cache_loc, *pool.scales(spec.layer_id),
                             qk_norm=norms)
        return batch.attn_backend.forward(q, k, v, spec, batch, save_kv=False)

    def _may_fuse_decode_rope(self, batch: ForwardBatch) -> bool:
        """Whether a pass's rotary and KV store go into the decode attention kernel: plain DECODE passes of a
        layer with one eps for its q/k norms and the plain rotary (not M-RoPE), when the backend can."""
        return (self.fuse_decode_rope and batch.is_decode and type(self.rotary[0]) is RotaryEmbedding
                and self.q_norm is not None and self.k_norm is not None and self.q_norm.eps == self.k_norm.eps
                and batch.attn_backend.can_fuse_decode_rope(self.spec, batch))


    def _qkv_rope_store(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                        prologue: AddRMSNorm) -> torch.Tensor | None:
        """One token's norm, q/k/v projection, (Qwen3: q/k norms,) rotary and KV store in one kernel (CUDA, batch 1),
        else None."""
        rotary = self.rotary[0]
        if not rotary.can_store_kv(x):
            return None
        spec, pool = self.spec, batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(spec.layer_id)
        k_scale, v_scale = pool.scales(spec.layer_id)
        qk_norm = None
        if self.q_norm is not None or self.k_norm is not None:
            if self.q_norm is None or self.k_norm is None or self.q_norm.eps != self.k_norm.eps \
                    or not self.qkv_proj.fuse_qwen3_qk_norm:
                return None
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return prologue.fused_gemv_rope(self.qkv_proj, x, dict(
            positions=positions, cos_cache=rotary.cos_cache, sin_cache=rotary.sin_cache, k_buffer=k_buf,
            v_buffer=v_buf, loc=batch.out_cache_loc, num_q_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, k_scale=k_scale, v_scale=v_scale), qk_norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 tp: TensorParallel = TP_NONE) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id, rotary, tp)
        inter = config.intermediate_size // tp.size  # this rank's MLP width
        # under data-parallel attention the ranks' partial sums are reduce-scattered by `dp`, not all-reduced here
        down = row_parallel_linear(inter, config.hidden_size, tp if not tp.dp_attention else TP_NONE)
        self.mlp: nn.Module = GatedMLP(config.hidden_size, inter, down)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.dp: DpAttention | None = None
        """Data-parallel attention's token exchange around the MLP (set by the model; None: the MLP runs here)."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over `(x, residual)` whose sum is the hidden state: the residual adds are
        fused into the next norm. Returns the MLP output and the residual stream before it."""
        if residual is None:
            h = self.self_attn(positions, self.input_layernorm(x), batch)
            residual = x
        else:  # each norm with its residual add is the prologue of the projection after it
            norm = AddRMSNorm(self.input_layernorm, residual)
            h = self.self_attn(positions, x, batch, norm)
            assert norm.summed is not None
            residual = norm.summed
        norm = AddRMSNorm(self.post_attention_layernorm, residual)
        out = self.mlp(h, norm) if self.dp is None else self.dp.mlp(self.mlp, norm.apply(h))
        assert norm.summed is not None
        return out, norm.summed


def _embedding(num_rows: int, dim: int) -> nn.Embedding:
    """An embedding table without nn.Embedding's random init: the loader fills it, and the init on the meta
    device runs through torch's decompositions, whose first use imports torch._dynamo (~1 s per start)."""
    return nn.Embedding.from_pretrained(torch.empty(num_rows, dim), freeze=False)


@dataclass
class HiddenCapture:
    """Where every pass stores the features an EAGLE draft head reads: row `slot` of `pool` for the token whose KV
    is in that slot (rejected drafts' slots are freed and overwritten, cached prefixes keep theirs)."""

    pool: torch.Tensor
    """[KV slots + 1, hidden * max(1, len(layers))] in the model's dtype."""
    layers: tuple[int, ...] = ()
    """EAGLE-3: the residual stream at the input of these layers (the number of layers: the last one's output),
    side by side; empty (EAGLE): the last hidden state after the final norm."""


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TP_NONE,
                 make_layer: Callable[[ModelConfig, int, RotaryEmbedding, TensorParallel], nn.Module] = DecoderLayer
                 ) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        vocab_tp = tp.attention_tp
        self.embed_tokens: VocabParallelEmbedding | nn.Embedding = (
            VocabParallelEmbedding(ShardLayout.of(config, vocab_tp.rank, vocab_tp.size), config.hidden_size, vocab_tp)
            if vocab_tp.enabled else _embedding(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(make_layer(config, i, self.rotary, tp) for i in range(config.num_layers))
        self.dp = DpAttention(tp) if tp.dp_attention else None
        """The token exchange of data-parallel attention (None without it)."""
        block = AttnBlockRuntime.from_env() if not tp.enabled else None
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                layer.dp = self.dp
                layer.self_attn.block = block
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.capture: HiddenCapture | None = None
        """Set (before CUDA graphs are captured) when an EAGLE head drafts for this model."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual: torch.Tensor | None = None
        capture = self.capture
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture.layers:
                self._store(capture, i, x if residual is None else x + residual, batch)
            x, residual = layer(positions, x, residual, batch)
        if capture is not None and len(self.layers) in capture.layers:
            self._store(capture, len(self.layers), x if residual is None else x + residual, batch)
        out = self.norm(x) if residual is None else self.norm.forward_add(x, residual)[0]
        if capture is not None and not capture.layers:
            capture.pool[batch.out_cache_loc] = out
        return out

    @staticmethod
    def _store(capture: HiddenCapture, layer: int, state: torch.Tensor, batch: ForwardBatch) -> None:
        width = state.shape[-1]
        for j, wanted in enumerate(capture.layers):  # (a layer may be asked for twice)
            if wanted == layer:
                capture.pool[batch.out_cache_loc, j * width:(j + 1) * width] = state


class CausalLM(nn.Module):
    """Returns next-token logits `[batch, vocab]` for the last new token of each request, followed by
    the logits of `batch.extra_logit_rows` when an extend pass asks for them."""

    rows_independent = True
    """Every layer works on a pass's token rows one by one (attention apart, which sees only its own request's), so
    rows no request owns never reach a real one (prefill graphs pad with such rows: engine/prefill_graphs.py)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = TP_NONE) -> None:
        super().__init__()
        self.config = config
        self.layout = ShardLayout.of(config, tp.rank, tp.size, tp.dp_attention)
        """This rank's share of the model (all of it without TP)."""
        self.model = DecoderModel(config, tp, self.make_layer)
        self.lm_head = (ParallelLMHead(self.layout, config.hidden_size, config.vocab_size, tp)
                        if tp.attention_tp.enabled else Linear(config.hidden_size, config.vocab_size, bias=False))
        self.init_buffers()

    def make_layer(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                   tp: TensorParallel) -> nn.Module:
        """Decoder layer `layer_id` (families whose layers differ override it)."""
        return DecoderLayer(config, layer_id, rotary, tp)

    def init_buffers(self) -> None:
        """Re-tie the LM head to the embedding (moving a model with `to_empty` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`input_embeds` [num_tokens, hidden] replaces the token embeddings (multimodal models)."""
        hidden = self.model(input_ids, positions, batch, input_embeds)  # [num_tokens, hidden]
        if not batch.is_decode:
            rows = torch.cumsum(batch.extend_seq_lens, 0) - 1  # [batch]
            if batch.extra_logit_rows is not None:
                rows = torch.cat([rows, batch.extra_logit_rows])  # [batch + num_extra]
            hidden = hidden[rows]
        dp = self.model.dp
        if dp is not None:  # every rank's rows, in the whole batch's order; rank 0 alone samples
            hidden = dp.logit_rows(hidden)
            if dp.tp.rank != 0:
                return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Copy checkpoint tensors into parameters by Hugging Face name; all must be present.

        `q_proj`/`k_proj`/`v_proj` and `gate_proj`/`up_proj` land in row ranges of the stacked
        `qkv_proj` and `gate_up_proj` parameters. Under TP only this rank's slice of each tensor is
        read (`ShardLayout.checkpoint_slice`; lazy sources read nothing else).
        """
        params = self.checkpoint_params()
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            target, shard = self._locate(name)
            if target not in params:
                raise ValueError(f"checkpoint has unexpected weight {name!r}")
            dest: torch.Tensor = params[target]
            if shard >= 0:
                start, size = self._shard_rows(target, shard)
                dest = dest.narrow(0, start, size)
            tensor, dest = take_shard(self.layout, name, tensor, dest)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add((target, shard))
        missing = [name for name in params for shard in self._shards_of(name) if (name, shard) not in loaded]
        if self.config.tie_word_embeddings and "lm_head.weight" in missing:
            missing.remove("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[0]!r}")

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        """The parameters `load_weights` fills by name and checks for completeness (all of them here)."""
        return dict(self.named_parameters())

    @staticmethod
    def _locate(name: str) -> tuple[str, int]:
        """The parameter a checkpoint tensor loads into, and its shard (-1: the whole parameter)."""
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module in STACKED_PARAMS:
            stacked, shard = STACKED_PARAMS[module]
            return f"{parent}.{stacked}.{leaf}", shard
        return name, -1

    def _shard_sizes(self, name: str) -> tuple[int, ...]:
        c = self.layout  # this rank's heads and MLP width
        if ".qkv_proj." in name:
            return (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        if ".gate_up_proj." in name:
            return (c.intermediate_size, c.intermediate_size)
        return ()

    def _shards_of(self, name: str) -> list[int]:
        return list(range(len(self._shard_sizes(name)))) or [-1]

    def _shard_rows(self, name: str, shard: int) -> tuple[int, int]:
        sizes = self._shard_sizes(name)
        return sum(sizes[:shard]), sizes[shard]
