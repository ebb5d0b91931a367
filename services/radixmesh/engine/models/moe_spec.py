"""The mixture-of-experts facts of a model (from its config.json) and where its experts live across ranks.

Plain arithmetic on the config, without torch: front ends check `--tp-size` / `--ep-size` against a model
before any process starts. Two ways to spread an MoE layer over the ranks of a tensor-parallel group:

- expert parallelism (`--ep-size` = `--tp-size`): each rank holds `num_experts / ep_size` whole experts;
- tensor parallelism of the experts (`--ep-size 1`): each rank holds every expert's slice of the MoE width.

Either way each rank's output is a partial sum of the layer's, so the ranks' outputs add up to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.model_config import ModelConfig


@dataclass(frozen=True)
class MoeSpec:
    """A model's experts: how many, how wide, how the router picks them, which layers have them."""

    num_experts: int
    """Experts per MoE layer."""
    top_k: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    moe_intermediate_size: int
    """MLP width of one expert."""
    renormalize: bool
    """The chosen experts' weights are divided by their sum (Qwen3-MoE `norm_topk_prob`; Mixtral always)."""
    sparse_layers: frozenset[int]
    """Layers whose MLP is the MoE block; the others run a dense MLP of `intermediate_size`."""

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise invalid_argument(f"model config: MoE needs 1 <= num_experts_per_tok ({self.top_k}) <= "
                                   f"the number of experts ({self.num_experts})")
        if self.moe_intermediate_size < 1:
            raise invalid_argument("model config: moe_intermediate_size must be >= 1")

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id in self.sparse_layers


def moe_spec(config: ModelConfig) -> MoeSpec | None:
    """The MoE facts of `config`, or None for a dense model."""
    style = config.model_family.moe  # (models/registry.py)
    if style is None:
        return None
    raw = config.raw
    layers = range(config.num_layers)
    if style == "mixtral":
        return MoeSpec(_int(raw, "num_local_experts", 8), _int(raw, "num_experts_per_tok", 2),
                       config.intermediate_size, True, frozenset(layers))
    num_experts = _int(raw, "num_experts", 0) or _int(raw, "num_local_experts", 0)
    step = max(_int(raw, "decoder_sparse_step", 1), 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    sparse = frozenset(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoeSpec(num_experts, _int(raw, "num_experts_per_tok", 8), _int(raw, "moe_intermediate_size", 0),
                   bool(raw.get("norm_topk_prob", False)), sparse)


def _int(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key)
    return default if value is None else int(value)


@dataclass(frozen=True)
class ExpertLayout:
    """One rank's experts of an MoE layer: which experts, and which columns of their MLP width."""

    num_experts: int
    """Experts of the whole layer."""
    expert_start: int
    """First expert on this rank."""
    num_local: int
    """Experts on this rank (all of them without expert parallelism)."""
    inter_begin: int
    """First column of each local expert's MLP width on this rank."""
    inter_local: int
    """Columns of each local expert's MLP width on this rank (all of them under expert parallelism)."""
    inter_size: int
    """MLP width of one whole expert (`moe_intermediate_size`)."""
    ep_rank: int
    """This rank's place among the expert-parallel ranks (0 without expert parallelism)."""
    ep_size: int
    """Ranks the experts are spread over (`--ep-size`)."""

    @classmethod
    def of(cls, spec: MoeSpec, rank: int = 0, tp_size: int = 1, ep_size: int = 1) -> ExpertLayout:
        """The layout of `rank` of a group of `tp_size` with `ep_size` in {1, tp_size}; INVALID_ARGUMENT naming the
        numbers when the experts cannot be split so."""
        if ep_size not in (1, tp_size):
            raise invalid_argument(f"--ep-size {ep_size}: experts spread over all ranks of the tensor-parallel group "
                                   f"(--ep-size {tp_size}) or none (--ep-size 1)", "ep_size")
        if ep_size > 1:
            if spec.num_experts % ep_size:
                raise invalid_argument(f"expert parallelism: the model's {spec.num_experts} experts cannot be split "
                                       f"over --ep-size {ep_size} (it must divide them)", "ep_size")
            local = spec.num_experts // ep_size
            width = spec.moe_intermediate_size
            return cls(spec.num_experts, rank * local, local, 0, width, width, rank, ep_size)
        if spec.moe_intermediate_size % tp_size:
            raise invalid_argument(f"tensor parallelism: --tp-size {tp_size} does not divide the experts' MLP width "
                                   f"{spec.moe_intermediate_size} (or spread the experts with --ep-size {tp_size})",
                                   "tp_size")
        width = spec.moe_intermediate_size // tp_size
        return cls(spec.num_experts, 0, spec.num_experts, rank * width, width, spec.moe_intermediate_size, 0, 1)

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    def is_local(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local


def check_experts(config: ModelConfig, tp_size: int, ep_size: int) -> None:
    """INVALID_ARGUMENT when `config` cannot run at `tp_size` / `ep_size` (a dense model takes only --ep-size 1)."""
    spec = moe_spec(config)
    if spec is None:
        if ep_size > 1:
            raise invalid_argument(f"--ep-size {ep_size}: {config.architecture} has no experts (expert parallelism "
                                   f"runs mixture-of-experts models)", "ep_size")
        return
    ExpertLayout.of(spec, 0, tp_size, ep_size)
