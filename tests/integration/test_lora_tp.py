"""LoRA under tensor parallelism (gloo, 2 rank processes on the CPU): adapters sharded like their layers give
Hugging Face PEFT's greedy tokens, mixed in one batch with the base model, with adapters taking turns on one
slot (slot writes reach every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..unit.lora_factory import peft_greedy, write_random_adapter
from ..unit.scheduler_factory import assert_no_leak, run_until_idle
from ..unit.test_lora_peft import MAX_NEW, PROMPTS, _req
from ..unit.tp_factory import close_scheduler, make_tp_scheduler, write_tiny_checkpoint

pytest.importorskip("peft")
pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("slots", [1, 2])
def test_tp2_mixed_adapters_match_peft(tmp_path: Path, slots: int) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny")
    adapters = {"r8": write_random_adapter(model, tmp_path / "r8", rank=8, seed=1),
                "r16": write_random_adapter(model, tmp_path / "r16", rank=16, seed=3, use_rslora=True,
                                            targets=["k_proj", "o_proj", "up_proj", "down_proj"])}
    prompts = PROMPTS[:2]
    want = {(name, i): peft_greedy(model, adapters[name] if name else None, p, MAX_NEW)
            for name in (None, "r8", "r16") for i, p in enumerate(prompts)}
    sched, col = make_tp_scheduler(model, 2, lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()),
                                   max_lora_rank=16, max_loras_per_batch=slots)
    try:
        for name, i in want:
            sched.add_request(_req(f"{name}-{i}", prompts[i], name))
        run_until_idle(sched)
        assert not col.errors, col.errors
        assert {key: col.tokens[f"{key[0]}-{key[1]}"] for key in want} == want
        assert_no_leak(sched)
    finally:
        close_scheduler(sched)
