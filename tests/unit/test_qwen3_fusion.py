"""Qwen3, Qwen3-MoE and Mixtral decoding one row at a time through the fused batch-1 kernels on the CPU: the Triton
interpreter runs them once the CUDA-only switch (`models.layers._fused`) is forced open and the GEMVs are on
(`enable_gemv`, RADIXMESH_QWEN3_FUSION=1). Greedy tokens equal transformers', with the q/k norms inside the q/k/v +
rotary + KV-store kernel and the MoE router with the post-attention norm counted as they run; `fuse_prologues=False`
runs neither, and without RADIXMESH_QWEN3_FUSION only the router's runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.models import layers
from radixmesh.engine.request import Req
from radixmesh.kernels import gemv_norm_out, gemv_rope
from radixmesh.wire.sampling import SamplingParams

from .moe_factory import PROMPTS, hf_greedy, write_hf_checkpoint
from .scheduler_factory import run_until_idle
from .tp_factory import close_scheduler, make_tp_scheduler

MAX_NEW = 4
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only: with CUDA the kernels run "
                                "compiled in tests/gpu/test_qwen3_fusion_gpu.py")


def _run_one_at_a_time(path: Path, want: list[list[int]], before: Any = None, **overrides: Any) -> None:
    """Greedy PROMPTS through a scheduler of one request at a time (one-row decode steps) equal `want`; `before(sched)`
    runs once the scheduler is built."""
    sched, col = make_tp_scheduler(path, 1, max_running_requests=1, **overrides)
    try:
        if before is not None:
            before(sched)
        for i, ids in enumerate(PROMPTS):
            params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(ids), params=params))
        run_until_idle(sched)
        assert not col.errors, col.errors
        assert [col.tokens[f"r{i}"] for i in range(len(PROMPTS))] == want
    finally:
        close_scheduler(sched)


def _counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"rope_qk_norm": 0, "router": 0}
    rope, router = gemv_rope.gemv_add_rmsnorm_rope, gemv_norm_out.gemv_add_rmsnorm_out

    def counted_rope(*args: Any, **kwargs: Any) -> Any:
        counts["rope_qk_norm"] += args[6].qk_norm is not None  # (x, residual, norm weight, eps, weight, scale, rope)
        return rope(*args, **kwargs)

    def counted_router(*args: Any, **kwargs: Any) -> Any:
        counts["router"] += 1
        return router(*args, **kwargs)

    monkeypatch.setattr(gemv_rope, "gemv_add_rmsnorm_rope", counted_rope)
    monkeypatch.setattr(gemv_norm_out, "gemv_add_rmsnorm_out", counted_router)
    return counts


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "mixtral"])
def test_batch_one_kernels_give_transformers_greedy_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           kind: str, fuse: bool) -> None:
    path, hf = write_hf_checkpoint(kind, tmp_path / kind)
    want = hf_greedy(hf, PROMPTS, MAX_NEW)
    monkeypatch.setattr(layers, "_fused", lambda x: True)
    monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", "1")
    counts = _counted(monkeypatch)

    def enable(sched: Any) -> None:
        assert layers.enable_gemv(sched.runner.model, fuse_prologues=fuse) > 0

    _run_one_at_a_time(path, want, enable)
    decode_steps = len(PROMPTS) * (MAX_NEW - 1)
    # moe_factory: 3 layers (the first one's attention without a residual add before it), qwen3_moe's 0 and 2 sparse,
    # mixtral's all three (its attention has no q/k norms); the router takes the fusion in every sparse layer
    assert counts["rope_qk_norm"] == (decode_steps * 2 if fuse and kind != "mixtral" else 0), counts
    routers = {"qwen3": 0, "qwen3_moe": 2, "mixtral": 3}[kind]
    assert counts["router"] == (decode_steps * routers if fuse else 0), counts


@pytest.mark.parametrize("kind,qk_norm_fusion,disabled", [("qwen3", "", False), ("qwen3", "1", False),
                                                       ("qwen3_moe", "", False), ("mixtral", "", False),
                                                       ("qwen3", "", True)])
def test_decode_attention_with_the_rotary_inside_gives_transformers_greedy_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, qk_norm_fusion: str, disabled: bool) -> None:
    """The Triton backend's decode kernel norms and rotates q and stores the new k/v itself
    (`forward_decode_rope`) in every decode pass of a layer with q/k norms whose q/k/v GEMV did not already
    (RADIXMESH_QWEN3_FUSION=1: all but the first layer's); Mixtral's attention has no q/k norms and keeps the
    rotary launch; `--disable-decode-rope-fusion` keeps it everywhere."""
    from radixmesh.engine.attention.triton_backend import TritonBackend

    path, hf = write_hf_checkpoint(kind, tmp_path / kind, head_dim=16)  # (the decode kernel's smallest)
    want = hf_greedy(hf, PROMPTS, MAX_NEW)
    monkeypatch.setattr(layers, "_fused", lambda x: True)
    monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", qk_norm_fusion)
    calls = {"decode_rope": 0}
    fused_decode = TritonBackend.forward_decode_rope

    def counted(self: TritonBackend, *args: Any, **kwargs: Any) -> Any:
        calls["decode_rope"] += 1
        return fused_decode(self, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, "forward_decode_rope", counted)
    _run_one_at_a_time(path, want, lambda sched: layers.enable_gemv(sched.runner.model), attention_backend="triton",
                       disable_decode_rope_fusion=disabled)
    fused_layers = 0 if kind == "mixtral" or disabled else 1 if qk_norm_fusion else 3
    assert calls["decode_rope"] == len(PROMPTS) * (MAX_NEW - 1) * fused_layers, calls


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_whole_moe_block_in_one_kernel_gives_transformers_greedy_tokens(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           kind: str) -> None:
    """RADIXMESH_MOE_PATH=block: every sparse layer's one-row decode pass runs its post-attention norm, router, top-k
    and experts in the persistent kernel (`kernels.moe_block`; one program under the interpreter)."""
    from radixmesh.kernels import moe_block

    path, hf = write_hf_checkpoint(kind, tmp_path / kind)
    want = hf_greedy(hf, PROMPTS, MAX_NEW)
    monkeypatch.setattr(layers, "_fused", lambda x: True)
    monkeypatch.setenv("RADIXMESH_MOE_PATH", "block")
    calls = {"block": 0}
    block = moe_block.moe_block_decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["block"] += 1
        return block(*args, **kwargs)

    def enable(sched: Any) -> None:
        layers.enable_gemv(sched.runner.model)
        sched.runner.model.moe_runtime.use_kernels = True  # the Triton MoE kernels on the CPU (interpreter)

    monkeypatch.setattr(moe_block, "moe_block_decode", counted)
    _run_one_at_a_time(path, want, enable)
    sparse_layers = {"qwen3_moe": 2, "mixtral": 3}[kind]
    assert calls["block"] == len(PROMPTS) * (MAX_NEW - 1) * sparse_layers, calls


def test_the_qwen3_router_fusion_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(layers.Linear(8, 8, bias=False))
    monkeypatch.delenv("RADIXMESH_QWEN3_FUSION", raising=False)
    layers.enable_gemv(model)
    assert model[0].fuse_prologues and not model[0].fuse_qwen3_qk_norm and model[0].fuse_qwen3_router
    for value, want in (("1", (True, True)), ("all", (True, True)), ("router", (False, True)),
                        ("qk-norm", (True, False)), ("0", (False, False)), ("off", (False, False))):
        monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", value)
        layers.enable_gemv(model)
        assert (model[0].fuse_qwen3_qk_norm, model[0].fuse_qwen3_router) == want, value
    monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", "1")
    layers.enable_gemv(model, fuse_prologues=False)
    assert not model[0].fuse_qwen3_qk_norm and not model[0].fuse_qwen3_router
    monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", "bogus")
    with pytest.raises(RadixMeshError, match="RADIXMESH_QWEN3_FUSION"):
        layers.enable_gemv(model)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "mixtral"])
def test_the_whole_attention_half_in_one_kernel_gives_transformers_greedy_tokens(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch,
                                                                                kind: str) -> None:
    """RADIXMESH_ATTN_BLOCK=on: every one-row decode pass of a layer after the first (the first has no residual add
    before its attention) runs its input norm, q/k/v, (q/k norms,) rotary, KV store, attention and o projection in
    the persistent kernel (`kernels.attn_block`; one program under the interpreter), Mixtral's without q/k norms."""
    from radixmesh.kernels import attn_block

    path, hf = write_hf_checkpoint(kind, tmp_path / kind, head_dim=16)
    want = hf_greedy(hf, PROMPTS, MAX_NEW)
    monkeypatch.setattr(layers, "_fused", lambda x: True)
    monkeypatch.setenv("RADIXMESH_ATTN_BLOCK", "on")
    calls = {"block": 0}
    block = attn_block.attn_block_decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["block"] += 1
        return block(*args, **kwargs)

    monkeypatch.setattr(attn_block, "attn_block_decode", counted)
    _run_one_at_a_time(path, want, lambda sched: layers.enable_gemv(sched.runner.model), attention_backend="triton")
    assert calls["block"] == len(PROMPTS) * (MAX_NEW - 1) * 2, calls


def test_the_whole_attention_half_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.engine.models.attn_block_runtime import AttnBlockRuntime

    monkeypatch.delenv("RADIXMESH_ATTN_BLOCK", raising=False)
    assert AttnBlockRuntime.from_env() is None
    monkeypatch.setenv("RADIXMESH_ATTN_BLOCK", "ON")
    assert AttnBlockRuntime.from_env() is not None
    monkeypatch.setenv("RADIXMESH_ATTN_BLOCK", "off")
    assert AttnBlockRuntime.from_env() is None
    monkeypatch.setenv("RADIXMESH_ATTN_BLOCK", "sometimes")
    with pytest.raises(RadixMeshError, match="RADIXMESH_ATTN_BLOCK"):
        AttnBlockRuntime.from_env()
