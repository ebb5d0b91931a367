"""Typed messages of disaggregation between a worker front end and its scheduler process.

Decode side: `ReserveReqMsg` (answered by a `QueryOutMsg`, possibly later, once KV is free),
`KVChunkInMsg` per received chunk, `TransferDoneReqMsg` (answered once every chunk landed),
`ResolveReservationMsg` (commit with the first token, or compute the prompt locally; its
tokens stream like a Generate), `CancelReservationMsg`.
Prefill side: `PrefillReqMsg` (its tokens stream like a Generate; `KVExportMsg`s carrying the
KV chunks come just before its last token), `ReleaseTransferMsg`.
Prefix sharing (docs/hicache.md) reuses both sides: the fetching worker reserves with `ReserveReqMsg`
and lands chunks like a decode worker, then `CommitFetchMsg` puts the fetched prefix into its radix
cache and runs the request; the exporting worker answers `ExportCachedReqMsg` with the KV it holds
(computing nothing) and `ReleaseTransferMsg` unlocks it.
"""

from __future__ import annotations

import msgspec

from radixmesh.wire.sampling import SamplingParams


class KVChunk(msgspec.Struct, frozen=True):
    """Layers [layer_begin, layer_end) of the KV of `num_tokens` consecutive prompt positions.

    What `data` holds is the transport's business: the KV itself (grpc) or where to fetch it
    (cuda-ipc: CUDA IPC handles on the prefill GPU; nixl: the prefill agent and its rows' addresses).
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
    lease_s: float = 0.0
    """The exporting side keeps what `data` refers to this long after the export at the latest (0: not said).
    A transport reading it later (nixl) rejects what lands after that, counted from its reservation's grant."""


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
    """A transport id, or auto (chosen per receiver: `transport.choice`)."""
    lease_s: float
    """The exported KV is released when `ReleaseTransferMsg` does not come this long after export."""
    transport_params: bytes = b""
    """The receiver's `ReceiverInfo` (msgpack), from `PrefillStart.transport_params`; empty: unknown."""


class KVExportMsg(msgspec.Struct, tag="disagg_export", frozen=True):
    rid: str
    transfer_id: str
    index: int
    count: int
    chunk: KVChunk


class ReleaseTransferMsg(msgspec.Struct, tag="disagg_release", frozen=True):
    transfer_id: str


# ---- prefix sharing ----------------------------------------------------------------------------
class ExportCachedReqMsg(msgspec.Struct, tag="disagg_export_cached", frozen=True):
    """Export the KV of positions [start_pos, end) of `input_ids` that this worker's radix cache holds on
    its device, `end` being as far as it holds them (nothing is computed). Answered like a PrefillReqMsg:
    `KVExportMsg` chunks, then one TokenOut (finish_reason "length") whose `cached_tokens` is `end`
    (end <= start_pos: nothing to send, no chunk). The KV stays locked until `ReleaseTransferMsg` or
    the lease."""

    rid: str
    transfer_id: str
    input_ids: list[int]
    start_pos: int
    transport: str
    lease_s: float
    transport_params: bytes = b""
    """The fetching side's `ReceiverInfo` (msgpack); empty: unknown."""


class PrefixLenReqMsg(msgspec.Struct, tag="disagg_prefix_len", frozen=True):
    """How much of `input_ids` this worker holds: answered {"device_len": n, "host_len": m} (m tokens beyond
    the device's n in the host tier)."""

    query_id: str
    input_ids: list[int]


class TrimReservationMsg(msgspec.Struct, tag="disagg_trim", frozen=True):
    """Keep only the first `num_tokens` reserved slots (the peer holds less of the prefix than was asked);
    sent before the first chunk lands."""

    reservation_id: str
    num_tokens: int


class CommitFetchMsg(msgspec.Struct, tag="disagg_commit_fetch", frozen=True):
    """The reservation holds the KV of a prefix of `input_ids` fetched from a peer: put it into the radix
    cache (when every layer arrived and no `fallback_reason` is given; else free it) and run the request
    here. Its tokens stream like a Generate's."""

    rid: str
    reservation_id: str
    input_ids: list[int]
    params: SamplingParams
    fallback_reason: str = ""
    """Why the fetched KV is not used (the fetch failed), for the fallback counter; "" to commit."""


DisaggToSchedulerMsg = (ReserveReqMsg | KVChunkInMsg | TransferDoneReqMsg | ResolveReservationMsg
                        | CancelReservationMsg | PrefillReqMsg | ReleaseTransferMsg | ExportCachedReqMsg
                        | PrefixLenReqMsg | TrimReservationMsg | CommitFetchMsg)
DISAGG_MSG_TYPES = (ReserveReqMsg, KVChunkInMsg, TransferDoneReqMsg, ResolveReservationMsg, CancelReservationMsg,
                    PrefillReqMsg, ReleaseTransferMsg, ExportCachedReqMsg, PrefixLenReqMsg, TrimReservationMsg,
                    CommitFetchMsg)
