"""RadixMeshError <-> gRPC status, and proto <-> engine type conversions."""

from __future__ import annotations

import grpc
import pytest

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.common.grpc_errors import ERROR_METADATA_KEY, from_grpc_status, to_grpc_status
from radixmesh.gateway.errors import to_http
from radixmesh.protocol import sampling_pb2
from radixmesh.wire import convert
from radixmesh.wire.load import WorkerLoad, load_from_proto, load_to_proto
from radixmesh.wire.messages import TokenOut
from radixmesh.wire.sampling import SamplingParams


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_round_trips_exactly(code: ErrorCode) -> None:
    exc = RadixMeshError(code, f"something {code.value}", param="temperature")
    status, details, trailing = to_grpc_status(exc, service="worker")
    assert isinstance(status, grpc.StatusCode) and status is not grpc.StatusCode.OK
    assert details == exc.message
    back = from_grpc_status(status, details, trailing)
    assert (back.code, back.message, back.param) == (code, exc.message, "temperature")
    assert to_http(back) == to_http(exc)  # the gateway answers as if the error were local


def test_status_codes_follow_grpc_meaning() -> None:
    def status(code: ErrorCode) -> grpc.StatusCode:
        return to_grpc_status(RadixMeshError(code, "x"))[0]

    assert status(ErrorCode.INVALID_ARGUMENT) is grpc.StatusCode.INVALID_ARGUMENT
    assert status(ErrorCode.UNSUPPORTED) is grpc.StatusCode.UNIMPLEMENTED
    assert status(ErrorCode.UNAVAILABLE) is grpc.StatusCode.UNAVAILABLE
    assert status(ErrorCode.RESOURCE_EXHAUSTED) is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_foreign_statuses_map_by_code_alone() -> None:
    down = from_grpc_status(grpc.StatusCode.UNAVAILABLE, "failed to connect", (), peer="10.0.0.1:50051")
    assert down.code is ErrorCode.UNAVAILABLE and "10.0.0.1:50051" in down.message
    assert from_grpc_status(grpc.StatusCode.DEADLINE_EXCEEDED, "late").code is ErrorCode.UNAVAILABLE
    assert from_grpc_status(grpc.StatusCode.CANCELLED, "").code is ErrorCode.ABORTED
    assert from_grpc_status(grpc.StatusCode.UNKNOWN, "boom").code is ErrorCode.INTERNAL
    assert from_grpc_status(grpc.StatusCode.UNIMPLEMENTED, "no").code is ErrorCode.UNSUPPORTED
    # metadata from another service under other keys is ignored
    other = from_grpc_status(grpc.StatusCode.NOT_FOUND, "gone", (("x-other", "1"),))
    assert other.code is ErrorCode.NOT_FOUND and other.message == "gone"
    assert ERROR_METADATA_KEY.endswith("-bin")  # gRPC sends binary metadata only under -bin keys


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(max_new_tokens=7, min_new_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                            frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1, stop=("\n", "END"),
                            stop_token_ids=(2, 3), ignore_eos=True, seed=-5, n=3, logprobs=True, top_logprobs=4,
                            logit_bias={11: -100.0, 12: 2.5}, skip_special_tokens=False, logprob_start_len=3)
    wire = sampling_pb2.SamplingParams.FromString(convert.sampling_to_proto(params).SerializeToString())
    assert convert.sampling_from_proto(wire) == params
    for grammar in ({"json_schema": '{"type": "object"}'}, {"regex": "[a-z]+"}, {"ebnf": 'root ::= "yes"'}):
        constrained = SamplingParams(**grammar)
        assert convert.sampling_from_proto(convert.sampling_to_proto(constrained)) == constrained


def test_every_sampling_field_crosses_the_wire() -> None:
    """A field added to the engine's SamplingParams must be added to sampling.proto too (nothing dropped)."""
    assert set(SamplingParams.__struct_fields__) == set(sampling_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def test_empty_sampling_message_takes_engine_defaults() -> None:
    assert convert.sampling_from_proto(sampling_pb2.SamplingParams()) == SamplingParams()
    greedy = convert.sampling_from_proto(sampling_pb2.SamplingParams(temperature=0.0))
    assert greedy.temperature == 0.0 and greedy.is_greedy


def test_token_out_to_chunk() -> None:
    out = TokenOut(rid="r1", token_ids=[5, 6], prompt_tokens=10, cached_tokens=4, completion_tokens=2,
                   logprobs=[-0.1, -0.2], top_logprobs=[[(5, -0.1), (9, -2.0)], [(6, -0.2)]],
                   finish_reason="stop", matched_stop=6)
    chunk = convert.proto_to_chunk(convert.token_out_to_proto(out, worker_id="w0"), text="hi")
    assert (chunk.rid, chunk.text, chunk.token_ids) == ("r1", "hi", [5, 6])
    assert (chunk.prompt_tokens, chunk.cached_tokens, chunk.completion_tokens) == (10, 4, 2)
    assert chunk.logprobs == pytest.approx([-0.1, -0.2])
    assert chunk.top_logprobs is not None and [[t for t, _ in pos] for pos in chunk.top_logprobs] == [[5, 9], [6]]
    assert (chunk.finish_reason, chunk.matched_stop) == ("stop", 6)
    running = convert.proto_to_chunk(convert.token_out_to_proto(
        TokenOut(rid="r2", token_ids=[1], prompt_tokens=3, cached_tokens=0, completion_tokens=1)), "")
    assert running.finish_reason is None and running.matched_stop is None and running.logprobs is None
    stopped = convert.proto_to_chunk(convert.token_out_to_proto(
        TokenOut("r3", [], 3, 0, 1, finish_reason="stop", matched_stop="END")), "")
    assert stopped.matched_stop == "END"


def test_prompt_logprobs_round_trip() -> None:
    out = TokenOut(rid="r", token_ids=[7], prompt_tokens=4, cached_tokens=0, completion_tokens=1,
                   input_logprobs=[None, -1.5, -0.25], input_top_logprobs=[None, [(3, -1.5), (8, -2.0)], [(4, -0.25)]])
    chunk = convert.proto_to_chunk(convert.token_out_to_proto(out), "")
    assert chunk.input_logprobs == [None, -1.5, -0.25]
    assert chunk.input_top_logprobs == [None, [(3, -1.5), (8, -2.0)], [(4, -0.25)]]
    plain = convert.proto_to_chunk(convert.token_out_to_proto(
        TokenOut("r", [7], 4, 0, 1, input_logprobs=[None, -1.5])), "")
    assert plain.input_logprobs == [None, -1.5] and plain.input_top_logprobs is None


def test_load_round_trip() -> None:
    stats = {"num_running_reqs": 3, "num_waiting_reqs": 1, "num_queued_prefill_tokens": 100,
             "num_running_decode_tokens": 250, "kv_used_tokens": 300, "max_total_num_tokens": 1000,
             "kv_usage": 0.3, "cache_hit_rate": 0.5, "max_running_requests": 8}
    load = WorkerLoad.from_stats(stats)
    assert load_from_proto(load_to_proto(load)) == load
    assert load.as_stats() == pytest.approx(stats)
