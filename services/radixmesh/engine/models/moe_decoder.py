"""Qwen3-MoE and Mixtral: the Llama-family decoder (models/llama.py) with sparse MoE blocks as MLPs.

Qwen3-MoE has Qwen3's attention (per-head q/k RMSNorm), a softmax router renormalized when `norm_topk_prob`, and
MoE blocks on the layers `decoder_sparse_step` and `mlp_only_layers` say (a dense MLP elsewhere). Mixtral has
Mistral's attention and an MoE block on every layer (renormalized top-2). Checkpoints name each expert's
projections apart (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`); they load into
this rank's stacked expert weights (`models.moe.FusedExperts`), reading only its experts or its slice of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.distributed.sharding import TP_NONE, TensorParallel, WeightSource
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.models.layers import RotaryEmbedding
from radixmesh.engine.models.llama import CausalLM, DecoderLayer
from radixmesh.engine.models.moe import FusedExperts, SparseMoeBlock
from radixmesh.engine.models.moe_runtime import MoeRuntime
from radixmesh.engine.models.moe_spec import MoeSpec, moe_spec

EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
                      "w2": "down"}
"""Checkpoint names of an expert's projections (Qwen3-MoE, Mixtral) -> FusedExperts' projections."""
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_RENAMES = ((".block_sparse_moe.", ".mlp."),)
"""Mixtral's checkpoint module names -> ours."""


class MoeCausalLM(CausalLM):
    """A Llama-family causal LM whose sparse layers' MLPs are `SparseMoeBlock`s (Qwen3-MoE, Mixtral)."""

    rows_independent = False
    """The router sends padding rows to experts too: their work and the dispatch's token counts change."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = TP_NONE) -> None:
        super().__init__(config, tp)
        spec = self.moe
        self.moe_runtime = MoeRuntime(spec.num_experts)
        """Shared by every MoE block (workspaces, expert-load counter, dispatch)."""
        for block in self.moe_blocks():
            block.runtime = self.moe_runtime

    @property
    def moe(self) -> MoeSpec:
        spec = moe_spec(self.config)
        assert spec is not None, f"{self.config.architecture} has no MoE layers"
        return spec

    def make_layer(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                   tp: TensorParallel) -> nn.Module:
        spec = moe_spec(config)
        assert spec is not None, f"{config.architecture} has no MoE layers"
        layer = DecoderLayer(config, layer_id, rotary, tp)
        if spec.is_sparse(layer_id):  # (built on the meta device: the dense MLP it replaces never had storage)
            layer.mlp = SparseMoeBlock(spec, config.hidden_size, tp)
        return layer

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def configure_engine(self, config: EngineConfig) -> None:
        """Take the engine's dispatch settings (`--moe-dispatch`) and its largest CUDA-graph batch."""
        self.moe_runtime.configure(config.moe_dispatch, config.moe_a2a_min_tokens, config.cuda_graph_max_bs)
        for block in self.moe_blocks():
            block.prepare_runtime()

    def server_info(self) -> dict[str, object]:
        """Assignments per expert so far and each expert-parallel rank's share (rank order)."""
        per_expert = self.moe_runtime.snapshot()
        layout = self.moe_blocks()[0].layout
        local = layout.num_local
        per_rank = [sum(per_expert[r * local:(r + 1) * local]) for r in range(layout.ep_size)]
        return {"moe_expert_assignments": per_expert, "moe_rank_assignments": per_rank,
                "moe_ep_size": layout.ep_size}

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """As `CausalLM.load_weights`, the experts' projections going to their layer's `FusedExperts`."""
        super().load_weights(self._take_experts(weights))
        for i, layer in enumerate(self.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if isinstance(experts, FusedExperts) and experts.missing():
                expert, projection = experts.missing()[0]
                raise ValueError(f"checkpoint is missing expert weights of layer {i}, e.g. expert {expert} "
                                 f"{projection} ({len(experts.missing())} in all)")

    def _take_experts(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """The stream without the experts' tensors, which it loads on the way."""
        for name, tensor in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            match = _EXPERT.fullmatch(name)
            if match is None:
                yield name, tensor
                continue
            layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
            if projection not in EXPERT_PROJECTIONS or layer >= len(self.model.layers):
                raise ValueError(f"checkpoint has unexpected weight {name!r}")
            experts = getattr(self.model.layers[layer].mlp, "experts", None)
            if not isinstance(experts, FusedExperts):
                raise ValueError(f"checkpoint has expert weights for layer {layer}, a dense layer: {name!r}")
            experts.load(expert, EXPERT_PROJECTIONS[projection], tensor)

    def checkpoint_params(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if ".experts." not in name}

    def split_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]] | None:
        """A whole (TP 1) model's stacked expert weight as the checkpoint tensors it is made of; None for the rest
        (random weights for a tensor-parallel rank: `distributed.dummy_weights`)."""
        parent, _, leaf = name.rpartition(".")
        if not parent.endswith(".experts") or leaf not in ("w13", "w2"):
            return None
        return _split_experts(parent, leaf, tensor)


def _split_experts(parent: str, leaf: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for e in range(tensor.shape[0]):
        if leaf == "w2":
            yield f"{parent}.{e}.down_proj.weight", tensor[e]
            continue
        gate, up = tensor[e].chunk(2, dim=0)
        yield f"{parent}.{e}.gate_proj.weight", gate
        yield f"{parent}.{e}.up_proj.weight", up
