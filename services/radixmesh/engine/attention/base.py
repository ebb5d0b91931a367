"""The attention-backend contract and the per-step batch description models see.

Each attention layer hands q/k/v to the backend, which writes k/v into the KV pool at
`out_cache_loc` and attends over the request's whole sequence as listed in `req_to_token`.
The exceptions: on CUDA the model's rotary kernel writes the rotated k and v into the
pool itself (one launch instead of two) and tells the backend so with `save_kv=False`; and a
backend that `can_fuse_decode_rope` does a decode pass's rotary (with Qwen3's q/k norms) and
that store inside its attention kernel (`forward_decode_rope`), one launch fewer again.
"""

from __future__ import annotations

import abc
import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixmesh.engine.memory import ReqToTokenPool, TokenToKVPool
    from radixmesh.engine.mm.runtime import MultimodalForward
    from radixmesh.kernels.decode_rope import DecodeRope


class ForwardMode(enum.Enum):
    """EXTEND runs new prompt tokens after a cached prefix; DECODE runs one token per request."""

    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True)
class TreeMask:
    """EXTEND of draft trees: which new tokens of a request each of its new tokens sees (beside the whole prefix)."""

    mask: torch.Tensor
    """[sum(n_i * n_i)] bool on the device: request i's `[n_i, n_i]` mask, row-major, from `indptr[i]`
    (row t, column j: new token t sees new token j; only ancestors-or-self, so never j > t)."""
    indptr: torch.Tensor
    """[batch + 1] int64 on the device."""
    masks_cpu: list[torch.Tensor]
    """Request i's `[n_i, n_i]` bool mask on the host (the reference backend's)."""


@dataclass
class ForwardBatch:
    """Everything one forward pass needs; tensors live on the model's device.

    Tokens of all requests are packed along one axis (`num_tokens`), request by
    request. In DECODE mode every request contributes exactly one token.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot each new token's k/v is written to
    req_pool_indices: torch.Tensor  # [batch] int64, row of each request in req_to_token
    seq_lens: torch.Tensor  # [batch] int64, tokens with KV after this pass (prefix + new)
    extend_prefix_lens: torch.Tensor  # [batch] int64, cached tokens before the new ones (EXTEND)
    extend_seq_lens: torch.Tensor  # [batch] int64, new tokens per request (1 each in DECODE)
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    seq_lens_cpu: list[int]  # host copies, so backends can plan without a device sync
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extra_logit_rows: torch.Tensor | None = None
    """EXTEND: [num_extra] int64 packed token indices whose logits are returned too (prompt log-probs)."""
    req_pool_indices_cpu: list[int] | None = None
    """Host copy of `req_pool_indices` (None: backends that need it read the device tensor, a sync)."""
    mm: MultimodalForward | None = None
    """EXTEND of a multimodal model: image features and M-RoPE positions (`radixmesh.engine.mm.runtime`)."""
    tree_mask: TreeMask | None = None
    """EXTEND verifying draft trees: the new tokens' mask over each other (None: causal)."""

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


class AttentionLayerSpec:
    """Static description of one attention layer, created by the model."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float) -> None:
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling


class AttentionBackend(abc.ABC):
    """Computes attention for packed tokens and stores their k/v in the KV pool.

    `forward` takes q `[num_tokens, num_heads, head_dim]` and k, v
    `[num_tokens, num_kv_heads, head_dim]` for the batch's new tokens, writes
    k/v into `forward_batch.token_to_kv_pool` at `out_cache_loc`, and returns
    the attention output `[num_tokens, num_heads * head_dim]`. Each new token
    attends causally to its own request's tokens only: the cached prefix, the
    earlier new tokens and itself (with `forward_batch.tree_mask`: the prefix and the
    new tokens its mask row allows; backends without `supports_tree_mask` refuse it).
    With `save_kv=False` the caller has already written k/v to `out_cache_loc` and the
    backend only reads the pool; k and v are then still the values written (rotated),
    which a backend may read instead of the pool.
    """

    supports_cuda_graph: bool = False
    """Whether `init_cuda_graph_state` / `init_forward_metadata_graph` are implemented."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:  # noqa: B027
        """Plan a pass once before the model runs (index tensors, splits); optional."""

    def init_cuda_graph_state(self, max_bs: int, context_len: int, kv_pool: TokenToKVPool, num_heads: int) -> int:
        """Allocate static planning buffers for DECODE graphs up to `max_bs`; return the most KV
        indices (sum of sequence lengths) one graph replay can take."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_graph(self, forward_batch: ForwardBatch, batch_size: int) -> None:
        """Plan a DECODE pass into the static buffers, with device work only (it is captured)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    supports_tree_mask: bool = False
    """Whether EXTEND passes take `ForwardBatch.tree_mask` (verifying EAGLE draft trees)."""

    supports_extend_graph: bool = False
    """Whether `init_extend_metadata_graph` is implemented (verify passes of speculative decoding)."""

    concurrent_passes: bool = False
    """Whether an EXTEND pass may run on one CUDA stream while a DECODE pass (graph or eager) runs on another: no
    buffer written by one is used by the other (the metadata is host state, set before each pass's launch)."""

    def init_extend_metadata_graph(self, forward_batch: ForwardBatch, extend_len: int, kv_indptr: torch.Tensor,
                                   kv_indices: torch.Tensor) -> None:
        """Plan an EXTEND pass of exactly `extend_len` new tokens per request into the caller's static
        buffers `kv_indptr` `[>= batch + 1]` and `kv_indices` `[>= sum(seq_lens)]`, with device work
        only (it is captured)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture extend passes")

    def enable_dense_prefill(self) -> None:
        """Send long prompts with nothing cached to a library kernel (`--enable-dense-prefill`); optional."""
        logging.getLogger(__name__).warning("--enable-dense-prefill: the %s backend has no dense prefill path; "
                                            "ignored", type(self).__name__)

    def warm_up(self, kv_pool: TokenToKVPool, num_heads: int, max_extend_tokens: int) -> None:  # noqa: B027
        """Prepare what the first passes of up to `max_extend_tokens` new tokens per request would otherwise pay
        for (library plans), once the pool exists; optional."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                forward_batch: ForwardBatch, save_kv: bool = True) -> torch.Tensor: ...

    def can_fuse_decode_rope(self, layer: AttentionLayerSpec, forward_batch: ForwardBatch) -> bool:
        """Whether `forward_decode_rope` runs this pass of `layer` (default: no backend can)."""
        return False

    def decode_kv_ranges(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(kv_indptr, kv_indices)` of a DECODE pass (request i attends to slots
        `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, its new token's last), for a kernel that attends by itself
        (`radixmesh.kernels.attn_block`); None where the backend keeps no such plan (the default)."""
        return None

    def disable_decode_rope_fusion(self) -> None:  # noqa: B027
        """Never fuse the rotary into decode attention (`--disable-decode-rope-fusion`); nothing to do for a backend
        that does not."""

    def forward_decode_rope(self, q: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                            rope: DecodeRope) -> torch.Tensor:
        """`forward` of a DECODE pass whose q `[n, heads, head_dim]` and `rope.k`, `rope.v` are raw (not normed, not
        rotated): the backend does the q/k norms and rotary and stores the new k/v at `rope.loc` itself, and returns
        what `forward` would after the model's rotary. Only where `can_fuse_decode_rope`; q and k are left as they
        were."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the rotary into decode attention")
