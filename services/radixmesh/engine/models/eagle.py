"""EAGLE and EAGLE-3 draft heads in their published checkpoint layouts (docs/speculative.md).

Both read the target's features of position t with the embedding of token t + 1 and predict the
next feature, whose logits give the draft token after it.

- EAGLE (`LlamaForCausalLMEagle`; published EAGLE-1/2 checkpoints say `LlamaForCausalLM`, the
  proposer overrides it): `fc` [hidden, 2 * hidden] (optional bias, config `bias`) over
  `cat(embed(token), feature)`, then `layers.0`, a Llama decoder layer without its input norm;
  the layer's output goes to the LM head as it is. The feature is the target's last hidden state
  after its final norm. `embed_tokens` and the LM head are the target's unless the checkpoint
  has them.
- EAGLE-3 (`LlamaForCausalLMEagle3`): the feature is three of the target's residual-stream states
  (inputs of layers 2, L/2 and L-3, or `eagle_config.eagle_aux_hidden_state_layer_ids` + 1),
  fused by `fc` [hidden, 3 * target hidden]; `midlayer` (or `layers.0`) normalises the embedding
  (`input_layernorm`) and the feature (`hidden_norm`) and attends over their concatenation
  (q/k/v take 2 * hidden inputs); its output is normed (`norm`) into `lm_head` over a draft
  vocabulary of `draft_vocab_size` tokens, draft id i being target id `i + d2t[i]`. Later draft
  steps feed the head's own output (pre-norm) instead of the fused feature.

Passes: an eager EXTEND pass reads the target features of its tokens from `features` (set by the
proposer); one replayed from a CUDA graph (`features` None) gathers them from the target's feature
pool by the static `feature_slots`. A DECODE pass reads the previous step's outputs from the static
buffer `draft_in`, so it replays in CUDA graphs. Every pass leaves its output features in
`hidden_out` (DECODE, static), `extend_hidden` (eager EXTEND) or `graph_hidden` (static EXTEND).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from radixmesh.engine.attention.base import ForwardBatch
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layers import AddRMSNorm, GatedMLP, Linear, RMSNorm, RotaryEmbedding
from radixmesh.engine.models.llama import STACKED_PARAMS, Attention, DecoderLayer, _embedding

GRAPH_EXTEND_ROWS = 256
"""Tokens of the largest EXTEND pass replayed from a graph (verify_graphs.MAX_GRAPH_TOKENS)."""
OPTIONAL_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
"""Weights a head may leave to the target (the proposer copies the target's in)."""


def eagle3_capture_layers(config: ModelConfig, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads (a value of `target_layers`: the last layer's output)."""
    ids = (config.raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return (2, target_layers // 2, target_layers - 3)


class _Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over `cat(norm(embedding), norm(feature))`, residual on the feature."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = Attention(config, 0, rotary)
        spec = self.self_attn.spec
        self.self_attn.qkv_proj = Linear(2 * h, (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim,
                                         bias=config.attention_bias)
        self.mlp = GatedMLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        attn = self.self_attn(positions, x, batch)
        norm = AddRMSNorm(self.post_attention_layernorm, feature)
        out = self.mlp(attn, norm)
        assert norm.summed is not None
        return out + norm.summed


class EagleDraft(nn.Module):
    """An EAGLE (1/2) draft head; `forward` returns logits over the target's vocabulary."""

    eagle3 = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        self.embed_tokens = _embedding(config.vocab_size, h)
        self.feature_dim = self._feature_dim()
        self.fc = Linear(self.feature_dim + (0 if self.eagle3 else h), h,
                         bias=bool(config.raw.get("bias", False)) and not self.eagle3)
        self._build_layer(config)
        for module in self.modules():  # its tree passes' padding beams read slots other rows write: keep the
            if isinstance(module, Attention):  # rotary's separate store (no fused decode rotary)
                module.fuse_decode_rope = False
        self.lm_head = Linear(h, self.draft_vocab, bias=False)
        self.features: torch.Tensor | None = None
        """EXTEND passes: `[tokens, feature_dim]` target features of the fed tokens (set before the pass)."""
        self.extend_hidden: torch.Tensor | None = None
        self.feature_pool: torch.Tensor | None = None
        """The target's features by KV slot (`HiddenCapture.pool`), read by graph-replayed EXTEND passes."""
        self.feature_slots = torch.empty(0, dtype=torch.int64)
        self.graph_hidden = torch.empty(0)
        self.draft_in = torch.empty(0)
        self.hidden_out = torch.empty(0)
        self.missing_optional: list[str] = [n for n in OPTIONAL_WEIGHTS if n != "lm_head.weight" or not self.eagle3]
        """Weights the checkpoint left to the target (all of them until weights load: dummy heads take the target's)."""
    def _feature_dim(self) -> int:
        return self.config.hidden_size

    @property
    def draft_vocab(self) -> int:
        return self.config.vocab_size

    def _build_layer(self, config: ModelConfig) -> None:
        layer = DecoderLayer(config, 0, self.rotary)
        layer.input_layernorm = nn.Identity()  # type: ignore[assignment]  # EAGLE's one layer has no input norm
        self.layers = nn.ModuleList([layer])

    def configure_engine(self, engine_config: Any) -> None:
        """Static buffers of DECODE passes (CUDA graphs read and write them): as many rows as a decode batch."""
        rows = max(engine_config.max_running_requests, engine_config.cuda_graph_max_bs) + 1
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        self.draft_in = torch.zeros(rows, self.config.hidden_size, device=device, dtype=dtype)
        self.hidden_out = torch.zeros(rows, self.config.hidden_size, device=device, dtype=dtype)
        self.feature_slots = torch.zeros(GRAPH_EXTEND_ROWS, dtype=torch.int64, device=device)
        self.graph_hidden = torch.zeros(GRAPH_EXTEND_ROWS, self.config.hidden_size, device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        n = input_ids.shape[0]
        embeds = self.embed_tokens(input_ids)
        if batch.is_decode:
            feature = self.draft_in[:n]
        elif self.features is not None:
            assert self.features.shape[0] == n, f"{self.features.shape[0]} features for an EXTEND pass of {n} tokens"
            feature = self.features
        else:  # a graph's static pass: features gathered by slot
            assert self.feature_pool is not None and n <= GRAPH_EXTEND_ROWS, "EXTEND pass without its features"
            feature = self.feature_pool.index_select(0, self.feature_slots[:n])
        hidden = self._hidden(positions, embeds, feature, batch, batch.is_decode)
        if batch.is_decode:
            self.hidden_out[:n].copy_(hidden)
        else:
            self.extend_hidden = hidden
            if self.features is None:
                self.graph_hidden[:n].copy_(hidden)
            rows = torch.cumsum(batch.extend_seq_lens, 0) - 1
            if batch.extra_logit_rows is not None:  # (a graph's pass returns every row's logits)
                rows = torch.cat([rows, batch.extra_logit_rows])
            hidden = hidden[rows]
        return self._logits(hidden)

    def _hidden(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor, batch: ForwardBatch,
                own: bool) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, feature], dim=-1))
        out, residual = self.layers[0](positions, x, None, batch)
        result: torch.Tensor = out + residual
        return result

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary ids (the same for EAGLE)."""
        return ids

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load by checkpoint name; `embed_tokens` and the LM head may be missing (`missing_optional` lists them)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, source in weights:
            name = self._rename(name)
            if self._load_extra(name, source):
                continue
            target, rows = self._locate(name)
            dest = params.get(target)
            if dest is None:
                raise ValueError(f"draft head checkpoint has unexpected weight {name!r}")
            tensor = source if isinstance(source, torch.Tensor) else source.narrow(0, 0, source.shape[0])
            region: torch.Tensor = dest if rows is None else dest.narrow(0, *rows)
            if tuple(region.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(region.shape)}")
            with torch.no_grad():
                region.copy_(tensor)
            loaded.add(target if rows is None else f"{target}:{rows[0]}")
        optional = [n for n in OPTIONAL_WEIGHTS if n != "lm_head.weight" or not self.eagle3]  # EAGLE-3: its own head
        self.missing_optional = [n for n in optional if n in params and n not in loaded]
        needed = {n for n in self._expected(params) if n not in optional}
        missing = sorted(needed - loaded)
        if missing:
            raise ValueError(f"draft head checkpoint is missing {len(missing)} weights, e.g. {missing[0]!r}")


    def _rename(self, name: str) -> str:
        return name.removeprefix("model.")

    def _load_extra(self, name: str, source: Any) -> bool:
        return False

    def _locate(self, name: str) -> tuple[str, tuple[int, int] | None]:
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module not in STACKED_PARAMS:
            return name, None
        stacked, shard = STACKED_PARAMS[module]
        c = self.config
        sizes = ((c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
                 if stacked == "qkv_proj" else (c.intermediate_size, c.intermediate_size))
        return f"{parent}.{stacked}.{leaf}", (sum(sizes[:shard]), sizes[shard])

    def _expected(self, params: dict[str, nn.Parameter]) -> set[str]:
        out: set[str] = set()
        for name in params:
            if ".qkv_proj." in name:
                out |= {f"{name}:{start}" for start in self._starts(3)}
            elif ".gate_up_proj." in name:
                out |= {f"{name}:0", f"{name}:{self.config.intermediate_size}"}
            else:
                out.add(name)
        return out

    def _starts(self, count: int) -> list[int]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return [0, q, q + kv][:count]


class Eagle3Draft(EagleDraft):
    """An EAGLE-3 draft head; `forward` returns logits over its draft vocabulary (`draft_to_target` maps ids)."""

    eagle3 = True

    def _feature_dim(self) -> int:
        return 3 * int(self.config.raw.get("target_hidden_size") or self.config.hidden_size)

    @property
    def draft_vocab(self) -> int:
        return int(self.config.raw.get("draft_vocab_size") or self.config.vocab_size)

    def _build_layer(self, config: ModelConfig) -> None:
        self.layers = nn.ModuleList([_Eagle3Layer(config, self.rotary)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def init_buffers(self) -> None:
        """The vocabulary maps (the checkpoint's `d2t`/`t2d`; identity on the first draft-vocabulary ids until then)."""
        device = self.fc.weight.device
        self.d2t = torch.zeros(self.draft_vocab, dtype=torch.int64, device=device)
        self.t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=device)
        self.t2d[:self.draft_vocab] = True

    def _rename(self, name: str) -> str:
        name = name.removeprefix("model.")
        return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name

    def _load_extra(self, name: str, source: Any) -> bool:
        if name not in ("d2t", "t2d"):
            return False
        tensor = source if isinstance(source, torch.Tensor) else source.narrow(0, 0, source.shape[0])
        dest = getattr(self, name)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        return True

    def _hidden(self, positions: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor, batch: ForwardBatch,
                own: bool) -> torch.Tensor:
        if not own:  # the target's three fused features; later steps read the head's own outputs
            feature = self.fc(feature)
        result: torch.Tensor = self.layers[0](positions, embeds, feature, batch)
        return result

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]
