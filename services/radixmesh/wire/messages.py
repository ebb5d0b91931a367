"""Typed messages between the engine client and the scheduler process (msgpack via msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from radixmesh.wire.disagg import DisaggToSchedulerMsg, KVExportMsg
from radixmesh.wire.images import MultimodalInputs
from radixmesh.wire.kv_events import KVEventsMsg
from radixmesh.wire.sampling import SamplingParams


class GenerateReqMsg(msgspec.Struct, tag="generate", frozen=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    """Compute and cache the prompt's KV, generate nothing (used to share a prompt across n branches)."""
    mm: MultimodalInputs | None = None
    """The prompt's preprocessed images (None: text only)."""
    output_ids: list[int] = msgspec.field(default_factory=list)
    """Output tokens generated before (a migrated request): the sequence continues after them."""
    lora: str | None = None
    """The LoRA adapter to run with (None: the base model)."""


class AbortReqMsg(msgspec.Struct, tag="abort", frozen=True):
    rid: str


class FlushCacheReqMsg(msgspec.Struct, tag="flush_cache", frozen=True):
    query_id: str


class ServerInfoReqMsg(msgspec.Struct, tag="server_info", frozen=True):
    query_id: str


class ShutdownReqMsg(msgspec.Struct, tag="shutdown", frozen=True):
    pass


class LoraLoadReqMsg(msgspec.Struct, tag="lora_load", frozen=True):
    """Load the PEFT adapter at `path` as `name`; answered with its rank and targets, or an error."""

    query_id: str
    name: str
    path: str


class LoraUnloadReqMsg(msgspec.Struct, tag="lora_unload", frozen=True):
    query_id: str
    name: str


class LoraListReqMsg(msgspec.Struct, tag="lora_list", frozen=True):
    query_id: str


ToSchedulerMsg = (GenerateReqMsg | AbortReqMsg | FlushCacheReqMsg | ServerInfoReqMsg | ShutdownReqMsg
                  | LoraLoadReqMsg | LoraUnloadReqMsg | LoraListReqMsg | DisaggToSchedulerMsg)


class TokenOut(msgspec.Struct, frozen=True):
    """New tokens of one request in one step; `finish_reason` is set on its last message."""

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    """stop | length | abort | error"""
    matched_stop: str | int | None = None
    """The stop string or stop token id that ended the request."""
    error: str | None = None
    error_code: str | None = None
    input_logprobs: list[float | None] | None = None
    """Prompt-token log-probs from `logprob_start_len` on, in order over the messages (None: the first token)."""
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    admitted_at: float | None = None
    """Wall-clock time (time.time()) the scheduler first admitted the request to a prefill batch: the
    end of its queue wait, for the front end's metrics and trace spans (None: not admitted, e.g. failed)."""
    host_load: tuple[float, float, int] | None = None
    """Hierarchical cache: (start, end, tokens) of the load of the prompt's prefix from the host tier
    (time.time()), during the queue wait; None when nothing was loaded."""


class BatchOutMsg(msgspec.Struct, tag="batch_out", frozen=True):
    outputs: list[TokenOut]


class QueryOutMsg(msgspec.Struct, tag="query_out", frozen=True):
    query_id: str
    result: dict[str, Any]


class ReadyMsg(msgspec.Struct, tag="ready", frozen=True):
    info: dict[str, Any]


class FatalMsg(msgspec.Struct, tag="fatal", frozen=True):
    message: str


FromSchedulerMsg = BatchOutMsg | QueryOutMsg | ReadyMsg | FatalMsg | KVEventsMsg | KVExportMsg

to_scheduler_decoder = msgspec.msgpack.Decoder(ToSchedulerMsg)
from_scheduler_decoder = msgspec.msgpack.Decoder(FromSchedulerMsg)
encoder = msgspec.msgpack.Encoder()
