"""Typed messages from tensor-parallel rank 0 to ranks 1..N-1 (and their status reports back).

Rank 0 sends one message before each unit of collectives it starts (a forward pass, the sampled
tokens, a KV gather or scatter); the other ranks run the same collectives in the same order.
Device data (KV slots, tokens, KV itself) does not ride these messages: it follows them as
broadcasts over the group (NCCL on CUDA), so rank 0 never copies device tensors to the host.
"""

from __future__ import annotations

import msgspec


class StepMsg(msgspec.Struct, tag="step", frozen=True):
    """One forward pass: a `ScheduleBatch` without its requests, plus the `req_to_token` writes since
    the previous step. A broadcast of `num_slots + sum(journal lengths)` int64 follows: the batch's
    `out_cache_loc`, then the values of each journal entry in order."""

    mode: str
    """extend | decode (`ForwardMode` values)."""
    input_ids: list[int]
    positions: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_pool_indices: list[int]
    future_rows: list[int] | None
    """Inputs that are the previous launch's sampled tokens (see `ScheduleBatch.future_rows`)."""
    logit_rows: list[int] | None
    """Packed rows whose logits are returned too (prompt log-probs): the LM head's gather must match."""
    num_slots: int
    """Length of `out_cache_loc` (tokens of this pass)."""
    journal: list[tuple[int, int, int]]
    """`(row, start, length)`: `req_to_token[row, start:start + length]` takes the next `length` values."""
    lora_slots: list[int] | None = None
    """Each request's LoRA adapter slot (-1: none); None when LoRA is off."""
    dp_ranks: list[int] | None = None
    """Data-parallel attention: each request's rank (each rank runs its own; the slots that follow are rank 0's
    numbering of every rank's pool, `engine.dp_kv`); None without it."""


class TokensMsg(msgspec.Struct, tag="tokens", frozen=True):
    """The tokens the last step sampled follow as an int64 broadcast of `num_tokens` (the next step's
    future inputs are resolved from them on every rank)."""

    num_tokens: int


class KVGatherMsg(msgspec.Struct, tag="kv_gather", frozen=True):
    """Gather layers `[layer_begin, layer_begin + num_layers)` of `num_tokens` slots (broadcast next) to
    rank 0 (KV export of prefill/decode disaggregation)."""

    num_tokens: int
    layer_begin: int
    num_layers: int


class KVScatterMsg(msgspec.Struct, tag="kv_scatter", frozen=True):
    """Write KV of every head (broadcast after the slots) into `num_tokens` slots: each rank keeps its heads."""

    num_tokens: int
    layer_begin: int
    num_layers: int


class StopMsg(msgspec.Struct, tag="stop", frozen=True):
    pass


class LoraSlotMsg(msgspec.Struct, tag="lora_slot", frozen=True):
    """Write the adapter rank 0 checked at `path` into `slot` (each rank its shard); no path: empty the slot."""

    slot: int
    name: str
    path: str | None


ToRankMsg = StepMsg | TokensMsg | KVGatherMsg | KVScatterMsg | StopMsg | LoraSlotMsg


class RankStatusMsg(msgspec.Struct, tag="status", frozen=True):
    """A rank reached `stage` (started | loaded), or failed (`error` set)."""

    rank: int
    stage: str
    error: str | None = None


to_rank_decoder = msgspec.msgpack.Decoder(ToRankMsg)
status_decoder = msgspec.msgpack.Decoder(RankStatusMsg)
encoder = msgspec.msgpack.Encoder()
