"""Conversions between protobuf messages and the engine's plain Python types, in one place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from radixmesh.common.errors import invalid_argument
from radixmesh.protocol import common_pb2, multimodal_pb2, sampling_pb2, worker_pb2
from radixmesh.wire.disagg import KVChunk, KVExportMsg
from radixmesh.wire.images import ImageInput, ImageSource, MultimodalInputs
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.outputs import GenerationChunk
from radixmesh.wire.sampling import SamplingParams

InputLogprobs = list[float | None] | None
InputTopLogprobs = list[list[tuple[int, float]] | None] | None

_FINISH_TO_PROTO: dict[str | None, common_pb2.FinishReason.ValueType] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
    "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS,
}
_FINISH_FROM_PROTO = {value: key for key, value in _FINISH_TO_PROTO.items()}

ROLE_TO_PROTO = {
    "unified": common_pb2.WORKER_ROLE_UNIFIED,
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
}
ROLE_FROM_PROTO = {value: key for key, value in ROLE_TO_PROTO.items()}


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason.ValueType:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: common_pb2.FinishReason.ValueType) -> str | None:
    return _FINISH_FROM_PROTO.get(value, "error")


# ---- sampling parameters --------------------------------------------------------------------------
_OptionalNoneField = Literal["seed", "json_schema", "regex", "ebnf", "structural_tag"]
"""Fields whose engine default is None: unset on the wire."""
_OptionalField = Literal["max_new_tokens", "temperature", "top_p", "repetition_penalty", "skip_special_tokens",
                        "logprob_start_len", _OptionalNoneField]
"""Fields that take the engine default when unset on the wire."""
_OPTIONAL_NONE_FIELDS: tuple[_OptionalNoneField, ...] = get_args(_OptionalNoneField)
_OPTIONAL_FIELDS: tuple[_OptionalField, ...] = get_args(_OptionalField)


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    msg = sampling_pb2.SamplingParams(
        max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens,
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty, stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, n=params.n,
        logprobs=params.logprobs, top_logprobs=params.top_logprobs, logit_bias=dict(params.logit_bias),
        skip_special_tokens=params.skip_special_tokens, logprob_start_len=params.logprob_start_len)
    for name in _OPTIONAL_NONE_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields (and n = 0) take the engine defaults; validation is the engine's."""
    defaults = SamplingParams()
    kwargs: dict[str, Any] = {
        "min_new_tokens": msg.min_new_tokens, "top_k": msg.top_k or -1, "min_p": msg.min_p,
        "frequency_penalty": msg.frequency_penalty, "presence_penalty": msg.presence_penalty,
        "stop": tuple(msg.stop), "stop_token_ids": tuple(msg.stop_token_ids), "ignore_eos": msg.ignore_eos,
        "n": msg.n or 1, "logprobs": msg.logprobs, "top_logprobs": msg.top_logprobs,
        "logit_bias": dict(msg.logit_bias),
    }
    for name in _OPTIONAL_FIELDS:
        kwargs[name] = getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)
    return SamplingParams(**kwargs)


# ---- generation stream ----------------------------------------------------------------------------
def token_out_to_proto(out: TokenOut, worker_id: str = "") -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(
        request_id=out.rid, token_ids=out.token_ids, logprobs=out.logprobs or [],
        prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
        completion_tokens=out.completion_tokens, finish_reason=finish_reason_to_proto(out.finish_reason),
        worker_id=worker_id)
    for entries in out.top_logprobs or []:
        msg.top_logprobs.add(entries=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in entries])
    _input_logprobs_to_proto(msg, out.input_logprobs, out.input_top_logprobs)
    if isinstance(out.matched_stop, str):
        msg.matched_stop_str = out.matched_stop
    elif isinstance(out.matched_stop, int):
        msg.matched_stop_token_id = out.matched_stop
    return msg


def _input_logprobs_to_proto(msg: worker_pb2.GenerateResponse, logprobs: InputLogprobs,
                             tops: InputTopLogprobs) -> None:
    for i, logprob in enumerate(logprobs or []):
        entry = msg.input_logprobs.add()
        if logprob is not None:
            entry.logprob = logprob
        top = tops[i] if tops is not None and i < len(tops) else None
        entry.top.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top or [])


def _input_logprobs_from_proto(msg: worker_pb2.GenerateResponse) -> tuple[InputLogprobs, InputTopLogprobs]:
    if not msg.input_logprobs:
        return None, None
    logprobs = [e.logprob if e.HasField("logprob") else None for e in msg.input_logprobs]
    if not any(e.top for e in msg.input_logprobs):
        return logprobs, None
    tops = [[(t.token_id, t.logprob) for t in e.top] if e.HasField("logprob") else None for e in msg.input_logprobs]
    return logprobs, tops


def matched_stop_from_proto(msg: worker_pb2.GenerateResponse) -> str | int | None:
    which = msg.WhichOneof("matched_stop")
    return None if which is None else getattr(msg, which)


def proto_to_chunk(msg: worker_pb2.GenerateResponse, text: str) -> GenerationChunk:
    """A gateway-side chunk of a streamed response, with its text detokenized elsewhere."""
    top = [[(e.token_id, e.logprob) for e in position.entries] for position in msg.top_logprobs]
    input_logprobs, input_tops = _input_logprobs_from_proto(msg)
    return GenerationChunk(
        rid=msg.request_id, text=text, token_ids=list(msg.token_ids), prompt_tokens=msg.prompt_tokens,
        cached_tokens=msg.cached_tokens, completion_tokens=msg.completion_tokens,
        logprobs=list(msg.logprobs) or None, top_logprobs=top or None,
        finish_reason=finish_reason_from_proto(msg.finish_reason), matched_stop=matched_stop_from_proto(msg),
        input_logprobs=input_logprobs, input_top_logprobs=input_tops,
        engine_ttft_s=msg.engine_ttft_s if msg.HasField("engine_ttft_s") else None)


# ---- disaggregation -------------------------------------------------------------------------------
def kv_chunk_to_proto(msg: KVExportMsg) -> worker_pb2.KVChunk:
    chunk = msg.chunk
    return worker_pb2.KVChunk(transport=chunk.transport, layer_begin=chunk.layer_begin, layer_end=chunk.layer_end,
                              num_tokens=chunk.num_tokens, dtype=chunk.dtype, data=chunk.data,
                              num_bytes=chunk.num_bytes, index=msg.index, count=msg.count, lease_s=chunk.lease_s)


def kv_chunk_from_proto(msg: worker_pb2.KVChunk) -> KVChunk:
    return KVChunk(transport=msg.transport, layer_begin=msg.layer_begin, layer_end=msg.layer_end,
                   num_tokens=msg.num_tokens, dtype=msg.dtype, data=msg.data, num_bytes=msg.num_bytes,
                   lease_s=msg.lease_s)


def prefill_result_to_proto(out: TokenOut, kv_bytes: int, worker_id: str) -> worker_pb2.PrefillResult:
    """The first token of a prefill (or, for an aborted one, only finish_reason ABORT)."""
    msg = worker_pb2.PrefillResult(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                                   kv_bytes=kv_bytes, worker_id=worker_id,
                                   finish_reason=finish_reason_to_proto(out.finish_reason))
    if out.token_ids:
        msg.token_id = out.token_ids[0]
    if out.logprobs:
        msg.logprob = out.logprobs[0]
    if out.top_logprobs:
        msg.top_logprobs.entries.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp)
                                        for t, lp in out.top_logprobs[0])
    return msg


_BY_TRANSPORT = ("transfers_received_by_transport", "transfers_sent_by_transport")
_DISAGG_STATS = tuple(name for name in worker_pb2.DisaggStats.DESCRIPTOR.fields_by_name
                      if name not in ("kv_transport", *_BY_TRANSPORT))


def disagg_stats_to_proto(stats: dict[str, Any], kv_transport: str = "") -> worker_pb2.DisaggStats:
    """The disaggregation counters of the scheduler's stats dict (keys as the message's field names; transfers by
    transport from `kv_transfers_received` / `kv_transfers_sent`), and the worker's --kv-transport."""
    msg = worker_pb2.DisaggStats(kv_transport=kv_transport)
    for name in _DISAGG_STATS:
        setattr(msg, name, int(stats.get(name, 0)))
    for field, key in zip(_BY_TRANSPORT, ("kv_transfers_received", "kv_transfers_sent")):
        getattr(msg, field).update({str(k): int(v) for k, v in (stats.get(key) or {}).items()})
    return msg


def disagg_stats_from_proto(msg: worker_pb2.DisaggStats) -> dict[str, Any]:
    """What /server_info shows of a worker's KV transfers: its --kv-transport (auto, or an id) and the transports
    its transfers used (keys as the scheduler's stats dict)."""
    return {"kv_transport": msg.kv_transport, "kv_transfers_received": dict(msg.transfers_received_by_transport),
            "kv_transfers_sent": dict(msg.transfers_sent_by_transport)}


# ---- images ---------------------------------------------------------------------------------------
def images_to_proto(mm: MultimodalInputs | None) -> list[multimodal_pb2.ImageInput]:
    if mm is None:
        return []
    return [multimodal_pb2.ImageInput(content_hash=i.content_hash, offset=i.offset, num_tokens=i.num_tokens,
                                      pixel_values=i.pixel_values, pixel_shape=list(i.pixel_shape),
                                      grid_thw=list(i.grid_thw or ())) for i in mm.images]


def images_from_proto(images: Sequence[multimodal_pb2.ImageInput]) -> MultimodalInputs | None:
    """None when there are none; a grid that is not (t, h, w) is INVALID_ARGUMENT naming `images`."""
    if not images:
        return None
    out = []
    for i, msg in enumerate(images):
        if len(msg.grid_thw) not in (0, 3):
            raise invalid_argument(f"images[{i}]: grid_thw must be empty or (t, h, w)", "images")
        grid = (msg.grid_thw[0], msg.grid_thw[1], msg.grid_thw[2]) if msg.grid_thw else None
        out.append(ImageInput(msg.content_hash, msg.offset, msg.num_tokens, msg.pixel_values,
                              tuple(msg.pixel_shape), grid))
    return MultimodalInputs(tuple(out))


def image_sources_to_proto(sources: Sequence[ImageSource]) -> list[multimodal_pb2.ImageSource]:
    return [multimodal_pb2.ImageSource(part=s.part, data=s.data) if s.data is not None
            else multimodal_pb2.ImageSource(part=s.part, url=s.url or "") for s in sources]


def image_sources_from_proto(sources: Sequence[multimodal_pb2.ImageSource]) -> list[ImageSource]:
    out = []
    for i, msg in enumerate(sources):
        part = msg.part or f"images[{i}]"
        out.append(ImageSource(part, data=msg.data) if msg.WhichOneof("source") == "data"
                   else ImageSource(part, url=msg.url))
    return out
