"""Typed messages of disaggregation between a worker front end and its scheduler process.

Decode side: `ReserveReqMsg` (answered by a `QueryOutMsg`, possibly later, once KV is free),
`KVChunkInMsg` per received chunk, `TransferDoneReqMsg` (answered once every chunk landed),
`ResolveReservationMsg` (commit with the first token, or compute the prompt locally; its
tokens stream like a Generate), `CancelReservationMsg`.
Prefill side: `PrefillReqMsg` (its tokens stream like a Generate; `KVExportMsg`s carrying the
KV chunks come just before its last token), `ReleaseTransferMsg`.
"""

from __future__ import annotations

import msgspec

from radixmesh.engine.sampling.params import SamplingParams


class KVChunk(msgspec.Struct, frozen=True):
    """Layers [layer_begin, layer_end) of the KV of `num_tokens` consecutive prompt positions.

    What `data` holds is the transport's business: the KV itself (grpc) or where to fetch it
    (cuda-ipc: a CUDA IPC handle of a staging buffer on the prefill GPU).
    """

    transport: str
    layer_begin: int
    layer_end: int
    num_tokens: int
    dtype: str
    """The pool's dtype (e.g. torch.bfloat16); both sides must match."""
    data: bytes
    num_bytes: int
    """Bytes of KV this chunk stands for (K and V of its layers and tokens)."""


# ---- decode side -------------------------------------------------------------------------------
class ReserveReqMsg(msgspec.Struct, tag="disagg_reserve", frozen=True):
    query_id: str
    reservation_id: str
    rid: str
    input_ids: list[int]
    params: SamplingParams
    lease_s: float
    """The reservation's slots are freed when it is not resolved this long after it was granted."""


class KVChunkInMsg(msgspec.Struct, tag="disagg_chunk_in", frozen=True):
    reservation_id: str
    chunk: KVChunk


class TransferDoneReqMsg(msgspec.Struct, tag="disagg_transfer_done", frozen=True):
    query_id: str
    reservation_id: str


class ResolveReservationMsg(msgspec.Struct, tag="disagg_resolve", frozen=True):
    """Commit the reservation with the first token, or (first_token < 0, or KV incomplete, or the
    reservation lapsed) compute the prompt here. Either way the request then runs under `rid`."""

    rid: str
    reservation_id: str
    input_ids: list[int]
    params: SamplingParams
    first_token: int = -1
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0
    """Prompt tokens the prefill worker took from its cache (reported to the client)."""
    fallback_reason: str = ""
    """Why the prompt is computed here (first_token < 0), for the fallback counter."""


class CancelReservationMsg(msgspec.Struct, tag="disagg_cancel", frozen=True):
    reservation_id: str


# ---- prefill side ------------------------------------------------------------------------------
class PrefillReqMsg(msgspec.Struct, tag="disagg_prefill", frozen=True):
    rid: str
    transfer_id: str
    input_ids: list[int]
    params: SamplingParams
    start_pos: int
    """First prompt position whose KV is exported (the decode worker holds the ones before)."""
    transport: str
    lease_s: float
    """The exported KV is released when `ReleaseTransferMsg` does not come this long after export."""


class KVExportMsg(msgspec.Struct, tag="disagg_export", frozen=True):
    rid: str
    transfer_id: str
    index: int
    count: int
    chunk: KVChunk


class ReleaseTransferMsg(msgspec.Struct, tag="disagg_release", frozen=True):
    transfer_id: str


DisaggToSchedulerMsg = (ReserveReqMsg | KVChunkInMsg | TransferDoneReqMsg | ResolveReservationMsg
                        | CancelReservationMsg | PrefillReqMsg | ReleaseTransferMsg)
DISAGG_MSG_TYPES = (ReserveReqMsg, KVChunkInMsg, TransferDoneReqMsg, ResolveReservationMsg, CancelReservationMsg,
                    PrefillReqMsg, ReleaseTransferMsg)
