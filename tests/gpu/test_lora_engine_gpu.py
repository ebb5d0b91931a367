"""LoRA adapters in the engine on a GPU (skipped without CUDA): a decode batch mixing adapters and the base model
gives the same greedy tokens replayed in CUDA graphs as run eagerly, and as the CPU's matmul path, with adapters
taking turns on fewer slots than adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixmesh.engine.bench.lora import write_random_adapters
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from ..unit.scheduler_factory import assert_no_leak, run_until_idle
from ..unit.tp_factory import TINY_SHAPE, close_scheduler, make_tp_scheduler, write_tiny_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 3, 99, 42, 8, 61], [7, 7, 12, 88, 3], list(range(1, 40)), [50] * 20]


def _run(model: Path, adapters: list[Path], slots: int, **overrides: object) -> dict[str, list[int]]:
    sched, col = make_tp_scheduler(model, 1, lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(adapters)),
                                   max_lora_rank=16, max_loras_per_batch=slots, **overrides)
    try:
        names: list[str | None] = [None, *[f"a{i}" for i in range(len(adapters))]]
        for i, prompt in enumerate(PROMPTS * 2):
            sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt), lora_name=names[i % len(names)],
                                  params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
        run_until_idle(sched)
        assert not col.errors, col.errors
        assert_no_leak(sched)
        return col.tokens
    finally:
        close_scheduler(sched)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slots,kernels", [(3, "auto"), (2, "auto"), (3, "rows"), (3, "grouped")])
def test_graphs_match_eager_and_cpu(tmp_path: Path, slots: int, kernels: str) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny")
    adapters = write_random_adapters(ModelConfig.from_hf_dict(TINY_SHAPE), tmp_path / "adapters", 3, 16, seed=5)
    cpu = _run(model, adapters, slots)
    gpu = dict(device="cuda", dtype="float32", disable_gemv=True, lora_kernels=kernels)
    graphs = _run(model, adapters, slots, **gpu)
    eager = _run(model, adapters, slots, disable_cuda_graph=True, **gpu)
    assert graphs == eager == cpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_base_requests_replay_the_graphs_without_lora_launches(tmp_path: Path) -> None:
    """A LoRA engine serving only base requests (bf16, the GEMV and its fused prologues on) gives the tokens of an
    engine without LoRA, through the graphs captured without the adapters' launches."""
    model = write_tiny_checkpoint(tmp_path / "tiny")
    adapters = write_random_adapters(ModelConfig.from_hf_dict(TINY_SHAPE), tmp_path / "adapters", 2, 16, seed=6)
    tokens = []
    for lora in (False, True):
        sched, col = make_tp_scheduler(model, 1, device="cuda", dtype="bfloat16",
                                       **({"lora_paths": (f"a0={adapters[0]}",), "max_lora_rank": 16} if lora else {}))
        try:
            for i, prompt in enumerate(PROMPTS):
                sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(prompt),
                                      params=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)))
            run_until_idle(sched)
            assert not col.errors, col.errors
            graphs = sched.runner.graph_runner
            assert graphs is not None and graphs.num_replays > 0
            assert graphs.variants == ((False, True) if lora else (False,))
            tokens.append(col.tokens)
        finally:
            close_scheduler(sched)
    assert tokens[0] == tokens[1]
