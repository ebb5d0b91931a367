"""Hot-path copies on CPU: packing, in-place writes, host results, future tokens and graph inputs.

On a CPU device `device_io` copies nothing and never waits; these tests pin down the layout
and values the CUDA path shares with it (tests/gpu/test_hot_path_gpu.py runs the same code
on a GPU under a sync detector).
"""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import ScheduleBatch, future_index, resolve_futures
from radixmesh.engine.cuda_graph_runner import GraphInputs, stage_inputs
from radixmesh.engine.device_io import HostCopy, copy_to_device, rows_to_device, tensor_to_device, to_device
from radixmesh.engine.request import Req
from radixmesh.engine.sampling.prompt_logprobs import PromptLogprobs
from radixmesh.engine.sampling.sampler import SampleOutput
from radixmesh.wire.sampling import SamplingParams

CPU = torch.device("cpu")


def test_to_device_keeps_values_and_dtype() -> None:
    t = to_device([3, -1, 7], torch.int64, CPU)
    assert t.dtype == torch.int64 and t.tolist() == [3, -1, 7]
    f = to_device([0.5, 2.0], torch.float32, CPU)
    assert f.dtype == torch.float32 and f.tolist() == [0.5, 2.0]
    assert to_device([], torch.int64, CPU).shape == (0,)


def test_rows_to_device_packs_rows_into_views_of_one_tensor() -> None:
    rows = [[1, 2, 3], [], [4], [5, 6]]
    views = rows_to_device(rows, CPU)
    assert [v.tolist() for v in views] == rows
    assert all(v.dtype == torch.int64 and v.is_contiguous() for v in views)
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views), "one copy for all rows"


def test_tensor_to_device_and_copy_to_device_write_only_their_target() -> None:
    host = torch.arange(6, dtype=torch.float32).view(2, 3)
    assert torch.equal(tensor_to_device(host, CPU), host)
    flat = torch.full((10,), -7, dtype=torch.int64)
    copy_to_device(flat[2:6], [9, 8, 7, 6])
    assert flat.tolist() == [-7, -7, 9, 8, 7, 6, -7, -7, -7, -7]
    with pytest.raises(AssertionError, match="4 values for a tensor of 3"):
        copy_to_device(flat[:3], [1, 2, 3, 4])


def test_host_copy_on_cpu_passes_tensors_through() -> None:
    a, b = torch.tensor([1, 2]), torch.tensor([[0.5]])
    copy = HostCopy([a, None, b])
    assert copy.ready()
    got = copy.wait()
    assert got[0] is a and got[1] is None and got[2] is b
    assert copy.wait() == got  # waiting twice is fine


def test_sample_output_to_host_matches_the_device_tensors() -> None:
    out = SampleOutput(next_token_ids=torch.tensor([4, 9]), logprobs=torch.tensor([-0.25, -1.5]),
                       top_logprob_ids=torch.tensor([[4, 1], [9, 2]]),
                       top_logprob_values=torch.tensor([[-0.25, -2.0], [-1.5, -1.75]]),
                       prompt_logprobs=PromptLogprobs(torch.tensor([-3.0]), torch.tensor([[5]]),
                                                      torch.tensor([[-0.5]])))
    out.start_copy()
    host = out.to_host()
    assert host.token_ids == [4, 9] and host.logprobs == [-0.25, -1.5]
    assert host.top_logprobs == [[(4, -0.25), (1, -2.0)], [(9, -1.5), (2, -1.75)]]
    assert host.prompt_logprobs == [-3.0] and host.prompt_top_logprobs == [[(5, -0.5)]]
    plain = SampleOutput(next_token_ids=torch.tensor([1])).to_host()  # starts its own copy
    assert plain.token_ids == [1] and plain.logprobs is None and plain.top_logprobs is None
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None


def _reference_futures(ids: list[int], rows: list[int], prev: torch.Tensor) -> list[int]:
    rows_t = torch.tensor(rows)
    return torch.where(rows_t >= 0, prev[rows_t.clamp(min=0)], torch.tensor(ids)).tolist()


@pytest.mark.parametrize("rows, num_prev", [
    ([0, 1, 2], 3),         # the previous batch again: copied as is
    ([2, 0], 3),            # all futures, other rows and order
    ([1, -1, 0, -1], 2),    # some ids known on the host
    ([-1, 0], 1),
], ids=["identity", "all-future", "mixed", "mixed-first-host"])
def test_resolve_futures_matches_a_where_over_the_previous_tokens(rows: list[int], num_prev: int) -> None:
    prev = torch.tensor([70, 71, 72][:num_prev])
    host_ids = [0 if r >= 0 else 50 + i for i, r in enumerate(rows)]
    plan = future_index(rows, num_prev)
    assert plan is not None
    assert plan.identity == (rows == list(range(num_prev)))
    assert plan.all_future == all(r >= 0 for r in rows)
    ids = torch.tensor(host_ids)
    resolve_futures(ids, plan, torch.tensor(plan.index), prev)
    assert ids.tolist() == _reference_futures(host_ids, rows, prev)


def test_no_future_rows_need_no_plan() -> None:
    assert future_index(None, 4) is None


def _decode_batch(kv_lens: list[int], pool_rows: list[int], input_ids: list[int], slots: list[int],
                  future_rows: list[int] | None) -> ScheduleBatch:
    reqs = [Req(rid=f"r{i}", origin_input_ids=[1, 2], params=SamplingParams()) for i in range(len(kv_lens))]
    return ScheduleBatch(ForwardMode.DECODE, reqs, input_ids, kv_lens, torch.tensor(slots), kv_lens,
                         [1] * len(kv_lens), pool_rows, future_rows)


@pytest.mark.parametrize("future_rows", [None, [1, 0, -1]], ids=["host-ids", "futures"])
def test_stage_inputs_fills_padded_views_and_req_to_token(future_rows: list[int] | None) -> None:
    padded, max_bs = 4, 8
    flat = torch.full((6 * max_bs,), 99, dtype=torch.int64)
    views = GraphInputs.of(flat, padded)
    views.out_cache_loc.fill_(55)  # stale slots of an earlier, larger batch
    req_to_token = torch.zeros(6, 16, dtype=torch.int64)
    batch = _decode_batch(kv_lens=[5, 9, 3], pool_rows=[4, 1, 2], input_ids=[0, 0, 33] if future_rows else [31, 32, 33],
                          slots=[101, 102, 103], future_rows=future_rows)
    prev = torch.tensor([41, 42])
    stage_inputs(views, views.head(3), batch, prev, req_to_token)
    assert views.positions.tolist() == [5, 9, 3, 0]
    assert views.req_pool_indices.tolist() == [4, 1, 2, 0]
    assert views.seq_lens.tolist() == [6, 10, 4, 1]
    assert views.input_ids.tolist() == ([42, 41, 33, 0] if future_rows else [31, 32, 33, 0])
    assert views.out_cache_loc.tolist() == [101, 102, 103, 0], "dummy rows must write to slot 0"
    assert req_to_token[4, 5] == 101 and req_to_token[1, 9] == 102 and req_to_token[2, 3] == 103
    assert int(req_to_token.count_nonzero()) == 3, "only the batch's new slots are recorded"
    assert flat[6 * padded:].eq(99).all(), "nothing past this size's six rows is touched"
