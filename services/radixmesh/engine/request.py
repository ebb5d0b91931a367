"""A request's state inside the scheduler process."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixmesh.wire.sampling import SamplingParams

if TYPE_CHECKING:
    from radixmesh.engine.grammar.base import GrammarMatcher
    from radixmesh.engine.mm.runtime import ReqImages
    from radixmesh.engine.radix_cache import TreeNode


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Req:
    """One sequence being generated.

    KV bookkeeping (page size 1): row `req_pool_idx` of `req_to_token` lists the KV
    slots of the first `kv_len` tokens of `all_ids`; the first `len(prefix_indices)`
    of them belong to the radix tree and are locked through `last_node`.
    """

    rid: str
    origin_input_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    """The tree node whose path this request has locked (None while waiting)."""
    matched_node: TreeNode | None = None
    """Where the last prefix match ended, before admission locks it."""
    kv_len: int = 0
    """Tokens whose KV is in the pool for this request."""
    extend_len: int = 0
    """New tokens in the current extend pass (a whole prompt or one chunk)."""
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    admitted_at: float | None = None
    """Wall-clock time of the first admission to a prefill batch (the end of the queue wait)."""
    is_chunked: bool = False
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    """The `ErrorCode` value of `error` (None: invalid_argument)."""
    futures: list[tuple[int, int]] = field(default_factory=list)
    """(launch id, row) of tokens sampled on the device but not yet appended, oldest first (overlap)."""
    grammar: GrammarMatcher | None = None
    """Matcher of the request's grammar (structured output), set once the grammar is compiled."""
    num_jumps: int = 0
    """Jump-forwards so far: each sent the request back to the queue to prefill the forced tokens."""
    host_load: tuple[float, float, int] | None = None
    """Hierarchical cache: (start, end, tokens) of the load of its prefix from the host tier (time.time())."""
    # per-step outputs not yet sent to the client
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprob_pos: int = -1
    """Next prompt position whose log-prob is still owed; len(prompt) when none is (set on creation)."""
    pending_input_logprobs: list[float | None] = field(default_factory=list)
    """Prompt-token log-probs computed but not yet sent; None for the first prompt token."""
    pending_input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    mm: ReqImages | None = None
    """The prompt's images (their positions hold pad ids, see radixmesh.wire.images); None: text only."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with (None: the base model)."""
    lora_slot: int = -1
    """The device slot holding its adapter while it is admitted (-1: none)."""
    cache_namespace: int = 0
    """Its prefix-cache namespace (`radixmesh.wire.lora.adapter_namespace`; 0: the base model's)."""
    dp_rank: int = -1
    """Data-parallel attention: the rank whose pool holds its KV, from its first admission on (-1: none yet)."""

    def __post_init__(self) -> None:
        start = self.params.logprob_start_len
        self.input_logprob_pos = start if 0 <= start < len(self.origin_input_ids) else len(self.origin_input_ids)

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by generated tokens: what the KV must eventually cover."""
        return self.origin_input_ids + self.output_ids

    def cache_key(self, ids: list[int]) -> list[int]:
        """`ids` as radix-cache keys: in a namespace of its own per adapter, so that two adapters never share
        KV and requests of one adapter do (`radixmesh.wire.lora`)."""
        if not self.cache_namespace:
            return ids
        from radixmesh.wire.lora import namespaced

        return namespaced(ids, self.cache_namespace)

    @property
    def fill_len(self) -> int:
        """Tokens that need KV before the next token can be sampled."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, counting one still on the device."""
        return len(self.output_ids) + len(self.futures)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.num_output_tokens, 0)

    @property
    def max_prefix_len(self) -> int:
        """Most cached tokens admission may reuse: one token is always computed, and the position
        before the first owed prompt log-prob must run so that its logits exist."""
        limit = self.fill_len - 1
        if self.owes_input_logprobs:
            limit = min(limit, max(self.input_logprob_pos - 1, 0))
        return limit

    @property
    def owes_input_logprobs(self) -> bool:
        return self.input_logprob_pos < len(self.origin_input_ids)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs or self.params.top_logprobs > 0
