"""Qwen3 and Qwen3-MoE at batch 1 with their fused GEMVs on a GPU: the q/k norms inside the q/k/v + rotary + KV-store
kernel (`kernels.gemv_rope`) and the MoE router with the post-attention norm (`kernels.gemv_norm_out`).

The engine in float32 (the GEMV kernels forced on for it) gives transformers' greedy tokens with the fused kernels
counted as they run (RADIXMESH_QWEN3_FUSION=1), and without them under `disable_gemv_fusion`; in bf16 fused and
unfused agree; the kernels at the Qwen3-30B-A3B and Qwen3-8B shapes match the launches they replace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

from ..unit.moe_factory import PROMPTS, hf_greedy, write_hf_checkpoint
from ..unit.scheduler_factory import run_until_idle
from ..unit.tp_factory import close_scheduler, make_tp_scheduler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GPU = dict(device="cuda", max_total_tokens=4096, cuda_graph_max_bs=4, mem_fraction_static=0.2,
           max_running_requests=1)  # one request at a time: every decode step is one row
MAX_NEW = 10


@pytest.fixture(autouse=True)
def qwen3_fusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Qwen3 fusions are opt-in (RADIXMESH_QWEN3_FUSION=1): on for every engine these tests build."""
    monkeypatch.setenv("RADIXMESH_QWEN3_FUSION", "1")


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, Path, list[list[int]]]:
    """(kind, checkpoint directory, transformers' greedy tokens for PROMPTS in float32 on the CPU)."""
    # heads of 16: the GPU's decode attention kernel takes head_dim >= 16 (the CPU tests' tiny models have 8)
    path, hf = write_hf_checkpoint(request.param, tmp_path_factory.mktemp("qwen3-fusion") / request.param,
                                   head_dim=16)
    return request.param, path, hf_greedy(hf, PROMPTS, MAX_NEW)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the fused kernels' launcher calls (in graphs: at capture), by kernel."""
    from radixmesh.kernels import gemv_norm_out, gemv_rope

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


def _greedy(path: Path, **overrides: Any) -> list[list[int]]:
    sched, col = make_tp_scheduler(path, 1, **{**GPU, **overrides})
    try:
        for i, ids in enumerate(PROMPTS):
            params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(ids), params=params))
        run_until_idle(sched)
        assert not col.errors, col.errors
        return [col.tokens[f"r{i}"] for i in range(len(PROMPTS))]
    finally:
        close_scheduler(sched)


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_tokens_match_transformers(checkpoint: tuple[str, Path, list], calls: dict[str, int],
                                               monkeypatch: pytest.MonkeyPatch, fusion: bool, graphs: bool) -> None:
    from radixmesh.engine import runner_build

    monkeypatch.setattr(runner_build, "GEMV_DTYPES", (*runner_build.GEMV_DTYPES, torch.float32))
    kind, path, want = checkpoint
    got = _greedy(path, dtype="float32", disable_gemv_fusion=not fusion, disable_cuda_graph=not graphs)
    assert got == want
    assert (calls["rope_qk_norm"] > 0) == fusion, calls
    assert (calls["router"] > 0) == (fusion and kind == "qwen3_moe"), calls


def test_bf16_fused_agrees_with_unfused(checkpoint: tuple[str, Path, list]) -> None:
    path = checkpoint[1]
    fused = _greedy(path, dtype="bfloat16")
    unfused = _greedy(path, dtype="bfloat16", disable_gemv_fusion=True)
    # bf16 paths round the projections' sums in other orders and can fork late where two tokens nearly tie
    assert sum(f[:4] == u[:4] for f, u in zip(fused, unfused)) >= len(PROMPTS) - 1, (fused, unfused)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("hq,hkv,k", [(32, 4, 2048), (32, 8, 4096)], ids=["qwen3-30b-a3b", "qwen3-8b"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_qk_norm_rope_kernel_at_real_shapes(hq: int, hkv: int, k: int, fp8: bool) -> None:
    from radixmesh.kernels.fp8_quant import quantize_rows
    from radixmesh.kernels.fused import KVStoreTarget, QKNorm, apply_rotary_
    from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm
    from radixmesh.kernels.gemv_rope import RopeStore, gemv_add_rmsnorm_rope

    dev, act, d = torch.device("cuda"), torch.bfloat16, 128
    gen = torch.Generator(device=dev).manual_seed(k + hkv)
    n = (hq + 2 * hkv) * d
    x, r = (torch.randn(2, k, device=dev, generator=gen).to(act)).chunk(2)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(act)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(act)
    weights = quantize_rows(w) if fp8 else (w, None)
    norm = QKNorm(*(1 + 0.2 * torch.randn(2, d, device=dev, generator=gen)).to(act), 1e-6)
    freqs = torch.outer(torch.arange(4096, device=dev, dtype=torch.float32),
                        1.0 / 1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
    cos, sin = freqs.cos(), freqs.sin()
    pos, loc = torch.tensor([3001], device=dev), torch.tensor([7], device=dev)
    want_k, want_v = torch.zeros(16, hkv, d, device=dev, dtype=act), torch.zeros(16, hkv, d, device=dev, dtype=act)
    got_k, got_v = want_k.clone(), want_v.clone()
    qkv, want_summed = gemv_add_rmsnorm(x, r, nw, 1e-6, *weights)  # the launches it replaces
    q, k_, v = qkv.view(1, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    apply_rotary_(q, k_, pos, cos, sin, KVStoreTarget(v.contiguous(), want_k, want_v, loc), norm)
    got, summed = gemv_add_rmsnorm_rope(x, r, nw, 1e-6, *weights,
                                        RopeStore(pos, cos, sin, got_k, got_v, loc, hq, hkv, d, qk_norm=norm))
    torch.cuda.synchronize()
    assert torch.equal(summed, want_summed)
    assert _rel_err(got, qkv) < 5e-3 and _rel_err(got_k[7], want_k[7]) < 5e-3 and _rel_err(got_v[7], want_v[7]) < 5e-3
    assert not got_k[:7].any() and not got_v[8:].any()


@pytest.mark.parametrize("n,k", [(128, 2048), (8, 4096)], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_router_kernel_at_real_shapes(n: int, k: int) -> None:
    from radixmesh.kernels.fused import rms_norm
    from radixmesh.kernels.gemv import gemv
    from radixmesh.kernels.gemv_norm_out import gemv_add_rmsnorm_out

    dev, act = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(n + k)
    x, r = (torch.randn(2, k, device=dev, generator=gen).to(act)).chunk(2)
    nw = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(act)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(act)
    want_h, want_summed = rms_norm(x, nw, 1e-6, r)
    want = gemv(want_h, w)
    got, h, summed = gemv_add_rmsnorm_out(x, r, nw, 1e-6, w)
    torch.cuda.synchronize()
    assert torch.equal(summed, want_summed)
    # the row's norm is one reduction in both kernels, in their own orders: at most one rounding step apart
    torch.testing.assert_close(h, want_h, atol=0.0, rtol=2 ** -7)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=2 ** -7)
