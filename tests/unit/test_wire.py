"""The vocabulary that crosses processes (radixmesh.wire): a worker's load with its one converter pair, the
messages between the front end and its scheduler, P/D messages and KV events through msgpack, and the proto
converters of KV chunks, prefill results and images."""

from __future__ import annotations

import msgspec
import pytest

from radixmesh.common.errors import RadixMeshError
from radixmesh.protocol import common_pb2, multimodal_pb2
from radixmesh.wire.convert import (
    disagg_stats_to_proto,
    finish_reason_from_proto,
    finish_reason_to_proto,
    image_sources_from_proto,
    image_sources_to_proto,
    images_from_proto,
    images_to_proto,
    kv_chunk_from_proto,
    kv_chunk_to_proto,
    prefill_result_to_proto,
)
from radixmesh.wire.disagg import DISAGG_MSG_TYPES, KVChunk, KVExportMsg, PrefillReqMsg, ReserveReqMsg
from radixmesh.wire.images import ImageInput, ImageSource, MultimodalInputs
from radixmesh.wire.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEventsMsg
from radixmesh.wire.load import WorkerLoad, load_from_proto, load_to_proto, sum_loads
from radixmesh.wire.messages import (
    AbortReqMsg,
    BatchOutMsg,
    GenerateReqMsg,
    QueryOutMsg,
    TokenOut,
    encoder,
    from_scheduler_decoder,
    to_scheduler_decoder,
)
from radixmesh.wire.sampling import SamplingParams

STATS = {"num_running_reqs": 3, "num_waiting_reqs": 1, "num_queued_prefill_tokens": 100,
         "num_running_decode_tokens": 250, "kv_used_tokens": 300, "max_total_num_tokens": 1000,
         "kv_usage": 0.25, "cache_hit_rate": 0.5, "max_running_requests": 8}


# ---- load -----------------------------------------------------------------------------------------
def test_a_load_reads_the_schedulers_stats_and_gives_them_back() -> None:
    load = WorkerLoad.from_stats({**STATS, "unrelated": "kept out"})
    assert (load.num_running_reqs, load.max_total_tokens, load.max_running_requests) == (3, 1000, 8)
    assert load.as_stats() == STATS
    assert WorkerLoad.from_stats({}) == WorkerLoad()


def test_a_load_crosses_the_wire_unchanged() -> None:
    load = WorkerLoad.from_stats(STATS)
    wire = common_pb2.WorkerLoad.FromString(load_to_proto(load).SerializeToString())
    assert load_from_proto(wire) == load
    assert load_from_proto(common_pb2.WorkerLoad()) == WorkerLoad()


def test_loads_add_up_and_the_hit_rate_averages() -> None:
    a = WorkerLoad(num_running_reqs=2, kv_used_tokens=100, max_total_tokens=400, cache_hit_rate=0.2)
    b = WorkerLoad(num_waiting_reqs=3, num_queued_prefill_tokens=50, kv_used_tokens=300, max_total_tokens=600,
                   cache_hit_rate=0.6, num_running_decode_tokens=7)
    total = sum_loads([a, b])
    assert (total.num_running_reqs, total.num_waiting_reqs, total.num_queued_prefill_tokens,
            total.num_running_decode_tokens) == (2, 3, 50, 7)
    assert (total.kv_used_tokens, total.max_total_tokens) == (400, 1000)
    assert total.kv_usage == pytest.approx(0.4) and total.cache_hit_rate == pytest.approx(0.4)
    assert sum_loads([]) == WorkerLoad()
    assert sum_loads(iter([a])).kv_usage == pytest.approx(0.25)  # any iterable, read once


# ---- front end <-> scheduler ------------------------------------------------------------------------
def test_requests_to_the_scheduler_decode_to_their_own_type() -> None:
    params = SamplingParams(max_new_tokens=3, temperature=0.0, stop=("x",))
    msgs = [GenerateReqMsg("r1", [1, 2, 3], params), AbortReqMsg("r1"),
            ReserveReqMsg("q", "res", "r2", [4, 5], params, 2.0),
            PrefillReqMsg("r3", "tx", [6], params, 0, "grpc", 1.0)]
    for msg in msgs:
        assert to_scheduler_decoder.decode(encoder.encode(msg)) == msg


def test_outputs_from_the_scheduler_decode_to_their_own_type() -> None:
    out = TokenOut("r", [5, 6], 3, 1, 2, logprobs=[-0.1, -0.2], top_logprobs=[[(5, -0.1)], [(6, -0.2)]],
                   finish_reason="stop", matched_stop=6)
    chunk = KVChunk("grpc", 0, 2, 4, "float32", b"\x00" * 8, 8)
    events = KVEventsMsg([BlocksStored([1, 2]), BlocksRemoved([3]), AllBlocksCleared(), BlocksStored([4], "host")], 16)
    for msg in (BatchOutMsg([out]), QueryOutMsg("q", {"ok": True}), events, KVExportMsg("r", "tx", 0, 1, chunk)):
        decoded = from_scheduler_decoder.decode(encoder.encode(msg))
        assert decoded == msg, type(msg).__name__


def test_every_disaggregation_message_has_a_tag_of_its_own() -> None:
    tags = [msgspec.inspect.type_info(t).tag for t in DISAGG_MSG_TYPES]  # type: ignore[attr-defined]
    assert len(tags) == len(set(tags)) and all(str(tag).startswith("disagg_") for tag in tags)


# ---- proto converters -------------------------------------------------------------------------------
@pytest.mark.parametrize("reason", [None, "stop", "length", "abort", "error"])
def test_finish_reasons_round_trip(reason: str | None) -> None:
    assert finish_reason_from_proto(finish_reason_to_proto(reason)) == reason


def test_kv_chunks_round_trip_with_their_place_in_the_export() -> None:
    chunk = KVChunk("cuda-ipc", 2, 4, 16, "bfloat16", b"handle", 2048)
    msg = kv_chunk_to_proto(KVExportMsg("r", "tx", 1, 3, chunk))
    assert (msg.index, msg.count) == (1, 3) and kv_chunk_from_proto(msg) == chunk


def test_a_prefill_result_carries_the_first_token_and_its_logprobs() -> None:
    out = TokenOut("r", [42], 10, 4, 1, logprobs=[-0.5], top_logprobs=[[(42, -0.5), (7, -1.0)]],
                   finish_reason="length")
    msg = prefill_result_to_proto(out, 4096, "w1")
    assert (msg.token_id, msg.logprob, msg.kv_bytes, msg.worker_id) == (42, -0.5, 4096, "w1")
    assert [(e.token_id, e.logprob) for e in msg.top_logprobs.entries] == [(42, -0.5), (7, -1.0)]
    aborted = prefill_result_to_proto(TokenOut("r", [], 10, 0, 0, finish_reason="abort"), 0, "w1")
    assert aborted.token_id == 0 and not aborted.top_logprobs.entries
    assert finish_reason_from_proto(aborted.finish_reason) == "abort"


def test_disaggregation_counters_are_the_messages_fields() -> None:
    msg = disagg_stats_to_proto({"num_committed": 3, "num_fallbacks": 1, "not_a_field": 9})
    assert (msg.num_committed, msg.num_fallbacks) == (3, 1)


def test_images_round_trip_and_a_bad_grid_is_named() -> None:
    mm = MultimodalInputs((ImageInput(2**63 + 5, 3, 4, b"\x00" * 16, (1, 4), (1, 2, 2)),
                           ImageInput(17, 10, 2, b"\x01" * 8, (2,), None)))
    assert images_from_proto(images_to_proto(mm)) == mm
    assert images_to_proto(None) == [] and images_from_proto([]) is None
    bad = multimodal_pb2.ImageInput(content_hash=1, grid_thw=[1, 2])
    with pytest.raises(RadixMeshError) as info:
        images_from_proto([bad])
    assert info.value.param == "images" and "images[0]" in info.value.message


def test_image_sources_keep_their_part_and_kind() -> None:
    sources = [ImageSource("messages[0].content[1].image_url", url="data:image/png;base64,AAAA"),
               ImageSource("image_data[1]", data=b"\x89PNG")]
    assert image_sources_from_proto(image_sources_to_proto(sources)) == sources
    unnamed = image_sources_from_proto([multimodal_pb2.ImageSource(url="https://x")])
    assert unnamed == [ImageSource("images[0]", url="https://x")]
