"""MoeRuntime on CPU: the dispatch choice, which path runs, the workspaces kept (graph-sized once, eager ones
grown to a power of two) and the expert-load counter."""

from __future__ import annotations

import pytest
import torch

from radixmesh.engine.models.moe_runtime import MOE_DISPATCHES, MoeRuntime
from radixmesh.engine.models.moe_spec import ExpertLayout
from radixmesh.kernels.moe import MoeWorkspace

CPU = torch.device("cpu")
DENSE = ExpertLayout(num_experts=8, expert_start=0, num_local=8, inter_begin=0, inter_local=32, inter_size=32,
                     ep_rank=0, ep_size=1)
EP = ExpertLayout(num_experts=8, expert_start=4, num_local=4, inter_begin=0, inter_local=32, inter_size=32,
                  ep_rank=1, ep_size=2)


def tokens(n: int) -> torch.Tensor:
    return torch.zeros(n, 16)


def test_defaults_and_configure_bounds() -> None:
    runtime = MoeRuntime(8)
    assert runtime.dispatch == "all-reduce" and runtime.a2a_min_tokens == 1024 and runtime.graph_max_tokens == 512
    runtime.configure("auto", 64, 0)
    assert (runtime.dispatch, runtime.a2a_min_tokens, runtime.graph_max_tokens) == ("auto", 64, 1)
    with pytest.raises(AssertionError, match="dispatch must be one of"):
        runtime.configure("ring", 64, 8)
    assert "ring" not in MOE_DISPATCHES


@pytest.mark.parametrize(("dispatch", "layout", "num_tokens", "expected"), [
    ("all-to-all", DENSE, 4096, False),  # no expert parallelism: never
    ("all-reduce", EP, 4096, False),
    ("all-to-all", EP, 1, True),
    ("auto", EP, 63, False),
    ("auto", EP, 64, True),
])
def test_all_to_all_only_under_expert_parallelism_and_from_the_threshold(
        dispatch: str, layout: ExpertLayout, num_tokens: int, expected: bool) -> None:
    runtime = MoeRuntime(8)
    runtime.configure(dispatch, 64, 512)
    assert runtime.use_all_to_all(layout, tokens(num_tokens)) is expected


def test_kernels_follow_the_device_unless_forced() -> None:
    runtime = MoeRuntime(8)
    assert not runtime.kernels_for(tokens(2))  # CPU: the PyTorch reference
    runtime.use_kernels = True
    assert runtime.kernels_for(tokens(2))
    runtime.use_kernels = False
    assert not runtime.kernels_for(tokens(2))


def workspace(runtime: MoeRuntime, num_tokens: int, top_k: int = 2, layout: ExpertLayout = DENSE,
              dtype: torch.dtype = torch.float32) -> MoeWorkspace:
    return runtime.workspace(num_tokens, top_k, layout, 16, dtype, None, CPU)


def test_small_batches_share_one_graph_sized_workspace() -> None:
    runtime = MoeRuntime(8)
    runtime.configure("all-reduce", 1024, 32)
    first = workspace(runtime, 1)
    assert first.y.shape == (32 * 2, 16)  # sized for the largest graph batch at once
    assert workspace(runtime, 32) is first and workspace(runtime, 7) is first


def test_eager_workspace_grows_to_the_next_power_of_two_and_is_reused_below() -> None:
    runtime = MoeRuntime(8)
    runtime.configure("all-reduce", 1024, 32)
    small = workspace(runtime, 8)
    big = workspace(runtime, 33)
    assert big is not small and big.y.shape[0] == 64 * 2
    assert workspace(runtime, 64) is big and workspace(runtime, 40) is big
    bigger = workspace(runtime, 65)
    assert bigger.y.shape[0] == 128 * 2 and workspace(runtime, 50) is bigger  # the grown one replaces it
    assert workspace(runtime, 4) is small  # graph-sized one untouched


def test_workspaces_are_per_layer_shape() -> None:
    runtime = MoeRuntime(8)
    runtime.configure("all-reduce", 1024, 16)
    base = workspace(runtime, 4)
    assert workspace(runtime, 4, top_k=4) is not base
    assert workspace(runtime, 4, layout=EP) is not base
    half = workspace(runtime, 4, dtype=torch.bfloat16)
    assert half is not base and half.y.dtype == torch.bfloat16
    assert workspace(runtime, 4) is base


def test_expert_load_counts_assignments_and_gathered_counts() -> None:
    runtime = MoeRuntime(4)
    assert runtime.snapshot() == [0, 0, 0, 0] and runtime.expert_load is None  # nothing routed yet
    runtime.count(torch.tensor([[0, 1], [1, 3], [1, 0]], dtype=torch.int32))
    assert runtime.snapshot() == [2, 3, 0, 1]
    runtime.add_counts(torch.tensor([1, 0, 5, 0], dtype=torch.int32))
    assert runtime.snapshot() == [3, 3, 5, 1]
    counter = runtime.load_counter(CPU)
    assert counter is runtime.expert_load and counter.dtype == torch.int64  # made once, then kept
    runtime.count(torch.zeros(0, 2, dtype=torch.int64))  # an empty pass adds nothing
    assert runtime.snapshot() == [3, 3, 5, 1]
