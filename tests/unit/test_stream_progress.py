"""What a relay keeps of a Generate stream to continue it elsewhere (radixmesh.router.migration)."""

from __future__ import annotations

from radixmesh.protocol import common_pb2, multimodal_pb2, sampling_pb2, worker_pb2
from radixmesh.router.migration import StreamProgress


def request(**fields: object) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id="r", token_ids=[1, 2, 3], sampling_params=sampling_pb2.SamplingParams(
        max_new_tokens=5, logprob_start_len=1), **fields)


def msg(ids: list[int], cached: int = 2, finish: int = 0, ttft: float | None = None) -> worker_pb2.GenerateResponse:
    out = worker_pb2.GenerateResponse(request_id="x", token_ids=ids, cached_tokens=cached, finish_reason=finish)
    if ttft is not None:
        out.engine_ttft_s = ttft
    return out


def test_first_leg_is_the_request_itself_then_a_resumption_under_leg_ids() -> None:
    original = request(prefill=worker_pb2.PrefillTarget(worker_id="p", address="a:1"))
    progress = StreamProgress(original)
    assert progress.next_request() is original and progress.leg_id == "r"
    progress.observe(msg([7, 8], ttft=0.5))
    leg = progress.next_request()
    assert (leg.request_id, list(leg.resume_output_ids)) == ("r~1", [7, 8])
    assert not leg.HasField("prefill") and not leg.sampling_params.HasField("logprob_start_len")
    assert list(leg.token_ids) == [1, 2, 3] and leg.sampling_params.max_new_tokens == 5
    assert progress.next_request().request_id == "r~1", "a retry of the same resumption keeps its id"
    first = progress.observe(msg([9], cached=0, ttft=0.1))
    assert (first.request_id, first.cached_tokens, first.HasField("engine_ttft_s")) == ("r", 2, False)
    assert progress.next_request().request_id == "r~2" and progress.output_ids == [7, 8, 9]
    assert original.request_id == "r" and not original.resume_output_ids, "the caller's request is not touched"


def test_what_cannot_resume() -> None:
    done = StreamProgress(request())
    done.observe(msg([1, 2], finish=common_pb2.FINISH_REASON_LENGTH))
    spent = StreamProgress(request())
    spent.observe(msg([1, 2, 3, 4, 5]))
    assert not done.can_resume() and not spent.can_resume()
    assert not StreamProgress(request(prefill_only=True)).can_resume()
    assert not StreamProgress(request(images=[multimodal_pb2.ImageInput()])).can_resume()
    assert StreamProgress(request()).can_resume()


def test_a_gateway_leg_tag_and_a_request_that_already_resumed() -> None:
    resumed = request(resume_output_ids=[4, 4])
    progress = StreamProgress(resumed, leg_tag="g")
    assert progress.num_sent == 0 and progress.next_request() is resumed
    progress.observe(msg([5]))
    leg = progress.next_request()
    assert (leg.request_id, list(leg.resume_output_ids)) == ("r~g1", [4, 4, 5])
