"""The small-batch MoE path (`moe_small`: top-k per token, gate/up per assignment, down per token with the
weighted sum) vs `moe_ref` and vs the sorted path, at tiny shapes (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before radixmesh.kernels is imported (see test_triton_kernels)

import pytest

from radixmesh.kernels.moe import SMALL_MAX_TOKENS, MoeWorkspace, fused_moe, takes_small_path
from radixmesh.kernels.moe_config import SmallMoeConfig, SmallTiles, small_default_config
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import RouterSpec, route_align
from radixmesh.kernels.moe_small import small_down, small_gate_up, small_topk

from .test_moe_kernels import DEVICE, _experts, _fp8, _rand, _rel_err

TAILS = SmallMoeConfig(SmallTiles(8, 32, 1, 1), SmallTiles(8, 16, 1, 1))  # N and K tails at the shapes below


def _topk(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None,
          load: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    m = logits.shape[0]
    ids = torch.full((m, spec.top_k), -1, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(m, spec.top_k, dtype=torch.float32, device=DEVICE)
    small_topk(logits.to(DEVICE), spec, ids, weights, correction_bias=None if bias is None else bias.to(DEVICE),
               expert_load=load)
    return ids.cpu(), weights.cpu()


# ---- top-k ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,bias", [
    (RouterSpec(1), False),
    (RouterSpec(2), False),
    (RouterSpec(8), False),
    (RouterSpec(2, renormalize=False), False),
    (RouterSpec(8, renormalize=False), False),
    (RouterSpec(3, scoring="sigmoid", routed_scaling_factor=2.5), True),
    (RouterSpec(8, scoring="sigmoid", renormalize=False), True),
    (RouterSpec(1, scoring="sigmoid"), False),
])
@pytest.mark.parametrize("m", [1, 4])
def test_topk_matches_reference_and_the_sorted_routing(spec: RouterSpec, bias: bool, m: int) -> None:
    logits = _rand(m, 24, seed=spec.top_k + m).to(torch.bfloat16)  # 24 experts: a padded row of 32
    correction = _rand(24, seed=9, scale=0.5) if bias else None
    ids, weights = _topk(logits, spec, correction)
    want_w, want_ids = route_ref(logits, spec.top_k, spec.scoring, spec.renormalize, spec.routed_scaling_factor,
                                 correction)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    al = route_align(logits.to(DEVICE), spec, 4, correction_bias=None if correction is None else correction.to(DEVICE))
    assert torch.equal(ids, al.topk_ids.cpu()) and torch.equal(weights, al.topk_weights.cpu())


def test_topk_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.0, 0.0],
                           [2.0] * 8,
                           [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    ids, weights = _topk(logits, RouterSpec(3))
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [2, 7, 0]]
    assert torch.equal(ids, route_ref(logits, 3)[1])
    torch.testing.assert_close(weights[1], torch.full((3,), 1 / 3))


def test_topk_adds_the_expert_load() -> None:
    logits = _rand(3, 16, seed=11)
    load = torch.full((16,), 5, dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        _topk(logits, RouterSpec(4), load=load)
    want = torch.bincount(route_ref(logits, 4)[1].view(-1).long(), minlength=16)
    assert load.cpu().tolist() == (5 + 2 * want).tolist()


# ---- the layer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("m,top_k", [(1, 1), (2, 2), (3, 8), (4, 2)])
def test_small_path_matches_reference(dtype: torch.dtype, tol: float, m: int, top_k: int) -> None:
    x, logits = _rand(m, 40, seed=m).to(dtype), _rand(m, 12, seed=m + 1)  # hidden 40, inter 20: ragged tiles
    w13, w2 = _experts(12, 40, 20, dtype)
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), RouterSpec(top_k), path="small",
                    small_config=TAILS)
    weights, ids = route_ref(logits, top_k)
    assert got.shape == (m, 40) and got.dtype == dtype
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < tol


@pytest.mark.parametrize("m", [1, 4])
def test_small_path_equals_the_sorted_path(m: int) -> None:
    x, logits = _rand(m, 64, seed=m + 3), _rand(m, 8, seed=m + 4)
    w13, w2 = (w.to(DEVICE) for w in _experts(8, 64, 32, torch.float32))
    args = (x.to(DEVICE), logits.to(DEVICE), w13, w2, RouterSpec(2, renormalize=False))
    small = fused_moe(*args, path="small")
    torch.testing.assert_close(small, fused_moe(*args, path="sorted"), rtol=1e-5, atol=1e-6)
    auto = small if takes_small_path(m, False, top_k=2, num_experts=8) else fused_moe(*args, path="sorted")
    torch.testing.assert_close(fused_moe(*args), auto, rtol=0, atol=0)


@pytest.mark.parametrize("expert_start,num_local", [(0, 4), (4, 4), (3, 2), (7, 1)])
def test_small_path_under_expert_parallelism(expert_start: int, num_local: int) -> None:
    x, logits = _rand(3, 32, seed=7), _rand(3, 8, seed=8)
    w13, w2 = _experts(8, 32, 16, torch.float32)
    lo, hi = expert_start, expert_start + num_local
    spec = RouterSpec(3)
    part = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13[lo:hi].to(DEVICE), w2[lo:hi].to(DEVICE), spec,
                     expert_start=lo, path="small")
    weights, ids = route_ref(logits, 3)
    want = moe_ref(x, w13[lo:hi], w2[lo:hi], weights, ids, expert_start=lo)
    torch.testing.assert_close(part.cpu(), want, rtol=1e-5, atol=1e-6)


def test_small_path_ranks_sum_to_the_whole_layer() -> None:
    x, logits = _rand(2, 32, seed=17), _rand(2, 8, seed=18)
    w13, w2 = _experts(8, 32, 16, torch.float32)
    args = (x.to(DEVICE), logits.to(DEVICE))
    whole = fused_moe(*args, w13.to(DEVICE), w2.to(DEVICE), RouterSpec(8), path="small")
    parts = [fused_moe(*args, w13[lo:lo + 4].to(DEVICE), w2[lo:lo + 4].to(DEVICE), RouterSpec(8), expert_start=lo,
                       path="small") for lo in (0, 4)]
    torch.testing.assert_close((parts[0] + parts[1]).cpu(), whole.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,top_k", [(1, 8), (4, 2)])
def test_small_path_fp8_experts(m: int, top_k: int) -> None:
    x, logits = _rand(m, 64, seed=m + 5).to(torch.bfloat16), _rand(m, 8, seed=m + 6)
    (q13, s13), (q2, s2) = (_fp8(w) for w in _experts(8, 64, 32, torch.float32))
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), q13.to(DEVICE), q2.to(DEVICE), RouterSpec(top_k),
                    w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), path="small")
    weights, ids = route_ref(logits, top_k)
    assert _rel_err(got, moe_ref(x, q13, q2, weights, ids, s13, s2)) < 3e-2


def test_small_path_with_sigmoid_scores_and_bias() -> None:
    x, logits = _rand(2, 32, seed=21), _rand(2, 8, seed=22)
    bias = _rand(8, seed=23, scale=0.5)
    w13, w2 = _experts(8, 32, 16, torch.float32)
    spec = RouterSpec(3, scoring="sigmoid", routed_scaling_factor=2.5)
    got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), spec,
                    correction_bias=bias.to(DEVICE), path="small")
    weights, ids = route_ref(logits, 3, "sigmoid", True, 2.5, bias)
    assert _rel_err(got, moe_ref(x, w13, w2, weights, ids)) < 1e-5


def test_small_path_reuses_a_workspace_and_writes_into_out() -> None:
    w13, w2 = (w.to(DEVICE) for w in _experts(8, 32, 16, torch.float32))
    ws = MoeWorkspace.allocate(4, 2, 8, 8, 32, 16, torch.float32, DEVICE, max_block_m=16)
    out = torch.full((4, 32), float("nan"), device=DEVICE)
    load = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    for m in (3, 1, 0):
        x, logits = _rand(m, 32, seed=m + 30), _rand(m, 8, seed=m + 31)
        got = fused_moe(x.to(DEVICE), logits.to(DEVICE), w13, w2, RouterSpec(2), workspace=ws, out=out[:m],
                        expert_load=load, path="small")
        assert got.shape == (m, 32)
        if m:
            assert got.data_ptr() == out.data_ptr()
            weights, ids = route_ref(logits, 2)
            assert _rel_err(got, moe_ref(x, w13.cpu(), w2.cpu(), weights, ids)) < 1e-5
    assert int(load.sum()) == 2 * (3 + 1)


FUSED = SmallMoeConfig(SmallTiles(4, 32, 1, 1), SmallTiles(4, 32, 1, 1), fuse_topk=True)


@pytest.mark.parametrize("spec,bias,expert_start,num_local", [
    (RouterSpec(2), False, 0, 8),
    (RouterSpec(8, renormalize=False), False, 0, 8),
    (RouterSpec(3, scoring="sigmoid", routed_scaling_factor=2.5), True, 2, 4),
    (RouterSpec(1), False, 5, 3),
])
def test_top_k_fused_into_gate_up_equals_its_own_launch(spec: RouterSpec, bias: bool, expert_start: int,
                                                        num_local: int) -> None:
    x, logits = _rand(3, 32, seed=41), _rand(3, 8, seed=42)
    correction = _rand(8, seed=43, scale=0.5).to(DEVICE) if bias else None
    w13, w2 = _experts(8, 32, 16, torch.float32)
    lo, hi = expert_start, expert_start + num_local
    args = (x.to(DEVICE), logits.to(DEVICE), w13[lo:hi].to(DEVICE), w2[lo:hi].to(DEVICE), spec)
    loads = [torch.zeros(8, dtype=torch.int64, device=DEVICE) for _ in range(2)]
    ws = [MoeWorkspace.allocate(3, spec.top_k, 8, num_local, 32, 16, torch.float32, DEVICE, 1) for _ in range(2)]
    fused, apart = (fused_moe(*args, correction_bias=correction, expert_start=lo, path="small", small_config=cfg,
                              workspace=w, expert_load=load)
                    for cfg, w, load in ((FUSED, ws[0], loads[0]), (None, ws[1], loads[1])))
    # the same ids; compiled, the two kernels' softmax may round an ulp apart (exact under the interpreter)
    assert torch.equal(ws[0].routing.topk_ids[:3], ws[1].routing.topk_ids[:3])
    torch.testing.assert_close(ws[0].routing.topk_weights[:3], ws[1].routing.topk_weights[:3], rtol=1e-6, atol=0)
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-6)
    assert torch.equal(loads[0], loads[1]) and int(loads[0].sum()) == 3 * spec.top_k


def test_path_choice() -> None:
    assert takes_small_path(1, False) and not takes_small_path(SMALL_MAX_TOKENS, False)
    assert takes_small_path(SMALL_MAX_TOKENS, False, top_k=8, num_experts=128)  # Qwen3-30B-A3B at M = 8
    assert not takes_small_path(16, False, top_k=8, num_experts=128)
    assert takes_small_path(2, False, top_k=2, num_experts=8) and not takes_small_path(4, False, top_k=2, num_experts=8)
    assert takes_small_path(SMALL_MAX_TOKENS, False, top_k=2, num_experts=8, fp8_weights=True)  # W8A16
    assert not takes_small_path(SMALL_MAX_TOKENS + 1, False, top_k=1, num_experts=1024, fp8_weights=True)
    assert not takes_small_path(1, True)
    assert takes_small_path(4096, False, "small") and not takes_small_path(1, False, "sorted")
    with pytest.raises(AssertionError, match="W8A16 only"):
        takes_small_path(1, True, "small")
    with pytest.raises(AssertionError, match="path must be one of"):
        takes_small_path(1, False, "fast")


def test_small_defaults_and_launcher_checks() -> None:
    gpu = torch.device("cuda")
    qwen3 = small_default_config(128, 768, 2048, 8, "bf16", gpu)
    assert qwen3.up.block_k == 256 and small_default_config(128, 768, 2048, 8, "fp8-w8a16", gpu).up.block_k == 512
    with pytest.raises(AssertionError, match="does not run"):
        small_default_config(128, 768, 2048, 8, "fp8-w8a8", gpu)
    with pytest.raises(AssertionError, match="power of 2"):
        SmallTiles(12, 64)
    x = torch.randn(2, 32, device=DEVICE)
    w13, w2 = (w.to(DEVICE) for w in _experts(8, 32, 16, torch.float32))
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    weights = torch.zeros(2, 2, device=DEVICE)
    tiles = SmallTiles(4, 32, 1, 1)
    with pytest.raises(AssertionError, match="topk_ids must be a contiguous int32"):
        small_topk(torch.randn(2, 8, device=DEVICE), RouterSpec(2), ids.long(), weights)
    with pytest.raises(AssertionError, match="out must be"):
        small_gate_up(x, ids, w13, tiles, torch.empty(2, 16, device=DEVICE))
    with pytest.raises(AssertionError, match="activations are"):
        small_gate_up(x, ids, w13.bfloat16(), tiles, torch.empty(4, 16, device=DEVICE))
    inter = torch.empty(4, 16, device=DEVICE)
    with pytest.raises(AssertionError, match=r"inter must be a torch.float32 \[4, 8\]"):
        small_down(inter, ids, weights, w2[:, :, :8], tiles, torch.empty(2, 32, device=DEVICE))
    with pytest.raises(AssertionError, match=r"out must be a torch.float32 \[2, 16\]"):
        small_down(inter, ids, weights, w2[:, :16], tiles, torch.empty(2, 32, device=DEVICE))
    with pytest.raises(AssertionError, match="w2 must be"):
        fused_moe(x, torch.randn(2, 8, device=DEVICE), w13, w2[:, :, :8], RouterSpec(2), path="small")
    with pytest.raises(AssertionError, match="local experts"):
        fused_moe(x, torch.randn(2, 8, device=DEVICE), w13, w2, RouterSpec(2), expert_start=4, path="small")


def test_radixmesh_moe_path_sets_the_models_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixmesh.common.env import MOE_PATHS as ENV_PATHS
    from radixmesh.common.env import moe_path
    from radixmesh.common.errors import RadixMeshError
    from radixmesh.engine.models.moe_runtime import MoeRuntime
    from radixmesh.kernels.moe import MOE_PATHS

    assert (*MOE_PATHS, "block") == ENV_PATHS
    monkeypatch.delenv("RADIXMESH_MOE_PATH", raising=False)
    assert moe_path() == "auto" and MoeRuntime(8).path == "auto"
    monkeypatch.setenv("RADIXMESH_MOE_PATH", " Sorted ")
    assert MoeRuntime(8).path == "sorted" and not MoeRuntime(8).block_kernel
    monkeypatch.setenv("RADIXMESH_MOE_PATH", "block")  # the whole-block kernel at one token, fused_moe's auto path else
    assert MoeRuntime(8).path == "auto" and MoeRuntime(8).block_kernel
    monkeypatch.setenv("RADIXMESH_MOE_PATH", "fast")
    with pytest.raises(RadixMeshError) as info:
        moe_path()
    assert info.value.param == "RADIXMESH_MOE_PATH"
