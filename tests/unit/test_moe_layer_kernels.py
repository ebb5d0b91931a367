"""The MoE layer's Triton path inside a model, on the CPU under the interpreter: the same greedy tokens as the
PyTorch reference path, the expert-load counter filled by the routing kernel, workspaces shared and kept for
graph-sized batches, FP8 experts, and the all-to-all dispatch's grouped GEMMs over received rows."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

from pathlib import Path
from typing import Any

import pytest

from radixmesh.engine.models.moe import SparseMoeBlock
from radixmesh.engine.models.moe_dispatch import _fused_received
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from .moe_factory import PROMPTS, write_hf_checkpoint
from .scheduler_factory import run_until_idle
from .tp_factory import make_tp_scheduler

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's test (GPUs run the kernels)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe-kernels") / "qwen3_moe")[0]


def _greedy(model_dir: Path, use_kernels: bool, **overrides: Any) -> tuple[list[list[int]], Any]:
    sched, col = make_tp_scheduler(model_dir, 1, **overrides)
    runtime = sched.runner.model.moe_runtime
    runtime.use_kernels = use_kernels
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt),
                              params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
    run_until_idle(sched)
    assert not col.errors, col.errors
    return [col.tokens[f"r{i}"] for i in range(len(PROMPTS))], sched


def test_kernels_in_the_model_give_the_reference_tokens(model_dir: Path) -> None:
    want, ref = _greedy(model_dir, False)
    got, sched = _greedy(model_dir, True)
    assert got == want
    runtime = sched.runner.model.moe_runtime
    assert runtime.snapshot() == ref.runner.model.moe_runtime.snapshot()  # the routing kernel's counts
    # one workspace for graph-sized batches (every pass here fits), shared by both sparse layers
    assert len(runtime._workspaces) == 1 and next(iter(runtime._workspaces))[0] is True


def test_large_passes_take_a_grown_workspace_and_small_ones_keep_theirs(model_dir: Path) -> None:
    _, sched = _greedy(model_dir, True, cuda_graph_max_bs=4)  # prompts of 6 and 20 tokens exceed 4
    runtime = sched.runner.model.moe_runtime
    small = [ws for key, ws in runtime._workspaces.items() if key[0]]
    large = [ws for key, ws in runtime._workspaces.items() if not key[0]]
    assert len(small) == 1 and small[0].y.shape[0] == 4 * 3  # 4 tokens x top-3
    assert len(large) == 1 and large[0].y.shape[0] >= 20 * 3


def test_fp8_kernels_give_the_reference_tokens(model_dir: Path) -> None:
    want, _ = _greedy(model_dir, False, quantization="fp8")
    got, _ = _greedy(model_dir, True, quantization="fp8")
    assert got == want


@pytest.mark.parametrize("fp8", [False, True])
def test_received_rows_through_the_grouped_gemms(model_dir: Path, fp8: bool) -> None:
    """The all-to-all path's expert step: each received row through its one expert, times its weight."""
    _, sched = _greedy(model_dir, True, quantization="fp8" if fp8 else None)
    block = next(m for m in sched.runner.model.modules() if isinstance(m, SparseMoeBlock))
    gen = torch.Generator().manual_seed(3)
    rows = 40 if fp8 else 9  # FP8: past W8A16_MAX_TOKENS the activations are quantized too (W8A8)
    x = torch.randn(rows, 32, generator=gen)
    ids = torch.randint(0, 8, (rows, 1), generator=gen, dtype=torch.int32)
    weights = torch.rand(rows, 1, generator=gen)
    got = _fused_received(block, x, ids, weights)
    want = block.expert_outputs(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=2e-2 if fp8 else 1e-4, atol=1e-3 if fp8 else 1e-5)
