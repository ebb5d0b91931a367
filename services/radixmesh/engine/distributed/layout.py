"""One rank's share of a model under tensor parallelism: plain arithmetic on the model's shape.

Apart from the sharded layers (radixmesh.engine.distributed.sharding) so that front ends can check a
`--tp-size` against a model without importing torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.model_config import ModelConfig

VOCAB_MODULES = ("embed_tokens", "lm_head")
"""Modules split by vocabulary rows (padded to a multiple of the TP size)."""


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of a model: which heads, MLP columns and vocabulary rows it holds."""

    rank: int
    """The rank this layout is for."""
    size: int
    """Ranks in the group."""
    head_dim: int
    """Width of one head (the same on every rank)."""
    num_heads: int
    """Query heads on this rank."""
    num_kv_heads: int
    """KV heads on this rank (1 when they are replicated)."""
    q_head_begin: int
    """First query head of this rank in the whole model."""
    kv_head_begin: int
    """First KV head of this rank in the whole model."""
    total_kv_heads: int
    """KV heads of the whole model."""
    intermediate_size: int
    """MLP width on this rank."""
    vocab_begin: int
    """First vocabulary row of this rank."""
    vocab_rows: int
    """Vocabulary rows of this rank's embedding and LM head (padded: the same on every rank)."""
    vocab_valid: int
    """Rows of `vocab_rows` that are real tokens (the rest are zero padding)."""
    dp_attention: bool = False
    """Data-parallel attention: attention, embedding and LM head whole on every rank; only the MLP width split."""

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1, dp_attention: bool = False) -> ShardLayout:
        """The layout of `rank` of `size`; INVALID_ARGUMENT naming the numbers when the model cannot be split.
        `dp_attention`: the layout of data-parallel attention (whole heads and vocabulary, the MLP width split)."""
        if dp_attention:
            whole = cls.of(config)
            if config.intermediate_size % size:
                raise invalid_argument(
                    f"data-parallel attention: --tp-size {size} does not divide the model's dense MLP width "
                    f"{config.intermediate_size}", "tp_size")
            return dataclasses.replace(whole, rank=rank, size=size, intermediate_size=config.intermediate_size // size,
                                       dp_attention=True)
        heads, kv_heads = config.num_heads, config.num_kv_heads
        if heads % size:
            raise invalid_argument(
                f"tensor parallelism: the model's {heads} attention heads cannot be split over --tp-size {size} "
                f"(the TP size must divide the number of heads)", "tp_size")
        if kv_heads >= size and kv_heads % size:
            raise invalid_argument(
                f"tensor parallelism: the model's {kv_heads} KV heads cannot be split over --tp-size {size} "
                f"(the TP size must divide the KV heads, or be a multiple of them)", "tp_size")
        if kv_heads < size and size % kv_heads:
            raise invalid_argument(
                f"tensor parallelism: --tp-size {size} is not a multiple of the model's {kv_heads} KV heads "
                f"(with fewer KV heads than ranks each KV head is replicated on size / KV heads ranks)", "tp_size")
        if config.intermediate_size % size:
            raise invalid_argument(
                f"tensor parallelism: --tp-size {size} does not divide the model's MLP width "
                f"{config.intermediate_size}", "tp_size")
        local_kv = max(kv_heads // size, 1)
        vocab_rows = -(-config.vocab_size // size)  # ceil
        vocab_begin = rank * vocab_rows
        return cls(rank=rank, size=size, head_dim=config.head_dim, num_heads=heads // size,
                   num_kv_heads=local_kv, q_head_begin=rank * (heads // size),
                   kv_head_begin=rank * kv_heads // size, total_kv_heads=kv_heads,
                   intermediate_size=config.intermediate_size // size, vocab_begin=vocab_begin,
                   vocab_rows=vocab_rows, vocab_valid=max(0, min(vocab_rows, config.vocab_size - vocab_begin)))

    @property
    def kv_replicated(self) -> bool:
        """Each KV head lives on several ranks (fewer KV heads than ranks)."""
        return not self.dp_attention and self.total_kv_heads < self.size

    def kv_source_ranks(self) -> list[int]:
        """One rank per KV head, in head order: the ranks whose shards tile the whole model's KV heads."""
        step = self.size // self.total_kv_heads if self.kv_replicated else 1
        return list(range(0, self.size, step))

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """`(dim, start, length)` of this rank's part of checkpoint tensor `name`; None: it is replicated.

        Vocabulary slices cover the real rows only (`vocab_valid`); the padding stays zero.
        """
        if self.size == 1:
            return None
        module_path, _, leaf = name.rpartition(".")
        module = module_path.rpartition(".")[2]
        d, inter = self.head_dim, self.intermediate_size
        if self.dp_attention and module not in ("gate_proj", "up_proj", "down_proj"):
            return None  # attention, norms, embedding and LM head are whole on every rank
        if module == "q_proj":
            return 0, self.q_head_begin * d, self.num_heads * d
        if module in ("k_proj", "v_proj"):
            return 0, self.kv_head_begin * d, self.num_kv_heads * d
        if module in ("gate_proj", "up_proj"):
            return 0, self.rank * inter, inter
        if module == "o_proj" and leaf == "weight":
            return 1, self.q_head_begin * d, self.num_heads * d
        if module == "down_proj" and leaf == "weight":
            return 1, self.rank * inter, inter
        if module in VOCAB_MODULES:
            return 0, self.vocab_begin, self.vocab_valid
        return None


def check_tensor_parallel(config: ModelConfig, tp_size: int, ep_size: int = 1, dp_attention: bool = False) -> None:
    """INVALID_ARGUMENT, naming the numbers, when `config` cannot run at `tp_size` (its experts at `ep_size`, its
    attention data-parallel with `dp_attention`)."""
    from radixmesh.engine.models.moe_spec import check_experts, moe_spec

    ShardLayout.of(config, 0, tp_size, dp_attention)
    if dp_attention and moe_spec(config) is None:
        raise invalid_argument(f"--enable-dp-attention runs mixture-of-experts models (with --ep-size {tp_size}); "
                               f"{config.architecture} has no experts: use tensor parallelism alone",
                               "enable_dp_attention")
    check_experts(config, tp_size, ep_size)
