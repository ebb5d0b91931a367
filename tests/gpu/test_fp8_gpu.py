"""FP8 on a GPU (compute capability >= 8.9): the kernels at real shapes against their references, the GEMM
plan, and small random models end to end with the real kernels, CUDA graphs and overlap."""

from __future__ import annotations

import gc
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # skipped then; keep the CPU tests' interpreter mode

import pytest

from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.quant.accuracy import checkpoint_weights, compare_fp8, prefill_logits, random_prompts
from radixmesh.engine.quant.gemm_plan import SCALED_MM, TRITON, Fp8GemmPlan
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.core import Scheduler
from radixmesh.kernels.decode_attention import decode_attention_fwd
from radixmesh.kernels.extend_attention import extend_attention_fwd
from radixmesh.kernels.fp8_gemm import fp8_gemm
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.fp8_ref import fp8_gemv_reference, quantize_scaled
from radixmesh.kernels.fp8_ref import quantize_rows as quantize_rows_ref
from radixmesh.kernels.gemv import gemv_fp8
from radixmesh.kernels.kv_store import build_kv_indices, store_kv
from radixmesh.kernels.reference import attention_reference
from radixmesh.wire.sampling import SamplingParams

from ..unit.fp8_factory import HF_CONFIG, quantized, write_checkpoint
from ..unit.scheduler_factory import Collector, make_requests, make_scheduler, run_until_idle
from .test_hot_path_gpu import GPU_ENGINE, _run_monitored, _warm_up, model_config

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def _ulp_mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of FP8 elements whose bits differ (each may differ by one ulp at most)."""
    a, b = got.view(torch.uint8).cpu().int(), want.view(torch.uint8).cpu().int()
    assert int((a - b).abs().max()) <= 1, "FP8 values differ by more than one ulp"
    return float((a != b).float().mean())


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 14336), (300, 4096)])
def test_quantize_rows_at_real_shapes(m: int, k: int) -> None:
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_ref(x.cpu())  # on the CPU: torch's CUDA division may round an ulp off
    q_ref, s_ref = q_ref.to(DEVICE), s_ref.to(DEVICE)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert _ulp_mismatch(q, q_ref) <= 1e-4


@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 16, 100, 1024])
def test_fp8_gemms_match_the_float32_product(n: int, k: int, m: int) -> None:
    xq, xs = quantize_rows(torch.randn(m, k, device=DEVICE))
    wq, ws = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.02)
    want = (xq.float() @ wq.float().t()) * xs[:, None] * ws[None, :]
    got = fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
    assert float((got.float() - want).norm() / want.norm()) < 1e-2
    if torch.cuda.get_device_capability() >= (9, 0):
        got = torch._scaled_mm(xq, wq.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
        assert float((got.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("n,k", SHAPES_8B)
def test_gemv_fp8_at_real_shapes(n: int, k: int) -> None:
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    wq, ws = quantize_rows(torch.randn(n, k, device=DEVICE) * 0.02)
    want = fp8_gemv_reference(x, wq, ws).float()
    assert float((gemv_fp8(x, wq, ws).float() - want).norm() / want.norm()) < 1e-2


def test_gemm_plan_measures_both_kernels_and_dispatches_by_m() -> None:
    plan = Fp8GemmPlan("auto", DEVICE, torch.bfloat16)
    plan.plan([(4096, 4096), (4096, 4104)])  # the second: N % 16 != 0 is never given to _scaled_mm
    assert set(plan.table[(4096, 4096)]) <= {SCALED_MM, TRITON} and set(plan.table[(4096, 4104)]) == {TRITON}
    assert plan.timings and all("choice" in row for row in plan.timings)
    print("FP8 GEMM plan:", plan.timings)
    for m in (1, 5, 3000):
        xq, xs = quantize_rows(torch.randn(m, 4096, device=DEVICE))
        wq, ws = quantize_rows(torch.randn(4096, 4096, device=DEVICE) * 0.02)
        want = (xq.float() @ wq.float().t()) * xs[:, None] * ws[None, :]
        assert float((plan(xq, xs, wq, ws).float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_store_and_attention_at_real_shapes(fp8: torch.dtype) -> None:
    heads, kv_heads, head_dim, seq_lens = 32, 8, 128, [2048, 17, 900]
    num_slots = sum(seq_lens) + 1
    k_scale, v_scale = 0.5, 2.0
    k_new = torch.randn(num_slots - 1, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16) * 3
    v_new = torch.randn_like(k_new)
    k_buf = torch.zeros(num_slots, kv_heads, head_dim, device=DEVICE, dtype=fp8)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(num_slots - 1, device=DEVICE) + 1
    store_kv(k_buf, v_buf, loc, k_new, v_new, k_scale, v_scale)
    assert _ulp_mismatch(k_buf[loc], quantize_scaled(k_new, 1 / k_scale, fp8)) <= 1e-4
    k_ref, v_ref = k_buf.float() * k_scale, v_buf.float() * v_scale
    req_to_token = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64, device=DEVICE)
    start = 0
    for row, n in enumerate(seq_lens):
        req_to_token[row, :n] = loc[start:start + n]
        start += n
    lens = torch.tensor(seq_lens, device=DEVICE)
    kv_indptr, kv_indices = build_kv_indices(req_to_token, torch.arange(3, device=DEVICE), lens, sum(seq_lens))
    q = torch.randn(3, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    decode_attention_fwd(q, k_buf, v_buf, out, kv_indptr, kv_indices, head_dim**-0.5, 8, k_scale=k_scale,
                         v_scale=v_scale)
    want = attention_reference(q, k_ref, v_ref, [0, 1, 2, 3], kv_indptr.tolist(), kv_indices, head_dim**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    new_lens = [64, 17, 300]
    qo = [0, 64, 81, 381]
    q = torch.randn(381, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    extend_attention_fwd(q, k_buf, v_buf, out, torch.tensor(qo, device=DEVICE), kv_indptr, kv_indices, max(new_lens),
                         head_dim**-0.5, k_scale, v_scale)
    want = attention_reference(q, k_ref, v_ref, qo, kv_indptr.tolist(), kv_indices, head_dim**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


# ---- small random models end to end -----------------------------------------------------------------------

GPU_CONFIG = dict(HF_CONFIG, vocab_size=4096, hidden_size=512, intermediate_size=1408, head_dim=64,
                  max_position_embeddings=2048, torch_dtype="bfloat16")


def _runner(**overrides: object) -> ModelRunner:
    settings: dict[str, object] = dict(device="cuda", dtype="bfloat16", max_total_tokens=65536,
                                       max_running_requests=128, load_format="dummy", cuda_graph_max_bs=16)
    settings.update(overrides)
    config = EngineConfig(**settings).resolve()  # type: ignore[arg-type]
    return ModelRunner(config, PreparedModel("tiny", ModelConfig.from_hf_dict(GPU_CONFIG), "dummy", None, None))


def test_fp8_against_bf16_on_random_weights_with_the_real_kernels() -> None:
    """100 prompts; see tests/unit/test_fp8_model.py for why top-1 agreement on random weights sits near 80%."""
    ref = _runner(disable_cuda_graph=True)
    fp8 = _runner(disable_cuda_graph=True, quantization="fp8", kv_cache_dtype="fp8_e4m3")
    result = compare_fp8(ref, fp8, random_prompts(100, GPU_CONFIG["vocab_size"], 4, 200, seed=0))
    print("FP8 vs bf16, random weights:", result)
    assert result["cosine_mean"] >= 0.99 and result["cosine_min"] >= 0.97, result
    assert result["top1_in_ref_top3"] >= 0.95 and result["top1_agreement"] >= 0.7, result


class _TopCollector(Collector):
    """Also keeps each token's top-5 alternatives (token id, log-prob)."""

    def __init__(self) -> None:
        super().__init__()
        self.top: dict[str, list[list[tuple[int, float]]]] = {}

    def __call__(self, outputs: list) -> None:
        super().__call__(outputs)
        for out in outputs:
            self.top.setdefault(out.rid, []).extend(out.top_logprobs or [])


def _generate(runner: ModelRunner, config: EngineConfig, prompts: list[list[int]],
              max_new: int) -> _TopCollector:
    collector = _TopCollector()
    sched = Scheduler(config, runner, None, collector)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    for i, ids in enumerate(prompts):
        sched.add_request(Req(rid=f"r{i}", origin_input_ids=list(ids), params=params))
    run_until_idle(sched)
    return collector


NEAR_TIE = 0.5
"""Log-prob gap (nats) under which two greedy runs may pick different tokens. Graph replay and eager decode
differ in bf16 rounding (the decode attention's split, cuBLAS's kernel choice); per-token FP8 quantization of
the next layer's input then moves a value by up to an eighth where it crosses a rounding boundary, so
near-ties flip (a 0.23-nat one did on an H100). A wrong graph (stale weights, scales, KV or positions) moves
every step's log-probs, which the check of the shared steps below catches."""
SHARED_STEP_MAX = 0.5
"""Largest log-prob difference of the same token at a step both runs share (nats). The same rounding moves a
shared step's log-prob too: while the weights were drawn from the unseeded global generator (a new draw each
run), the worst step was 0.27, 0.28 and 0.19 nats in three runs of the same code on H100s (2026-11-27; 0.25, the
bound before, failed two of them), 0.17 with the previous extend kernel. Seeded, four runs give the same 0.19."""
SHARED_STEP_MEDIAN = 0.025
"""Bound on the median of those differences: a wrong graph moves every step, rounding only a few (median 0.0)."""


def test_fp8_weights_and_kv_decode_in_cuda_graphs_with_overlap_like_eager() -> None:
    prompts = random_prompts(16, GPU_CONFIG["vocab_size"], 5, 300, seed=1)  # 16: a captured batch, no padding
    outputs = {}
    weights = None
    for mode, overrides in (("eager", dict(disable_cuda_graph=True, overlap_schedule="off")),
                            ("graphs", dict(overlap_schedule="on"))):
        # one GEMM backend for both: `auto` times the backends at each load and two loads may pick differently
        runner = _runner(quantization="fp8", kv_cache_dtype="fp8_e4m3", fp8_gemm_backend="scaled-mm", **overrides)
        if weights is None:  # the same wide random weights in both (seeded: every run draws the same)
            ref = _runner(disable_cuda_graph=True)
            gen = torch.Generator(device=DEVICE).manual_seed(7)
            with torch.no_grad():
                for p in ref.model.parameters():
                    if p.dim() == 2:
                        p.copy_(torch.randn(p.shape, generator=gen, device=DEVICE, dtype=p.dtype) / p.shape[1] ** 0.5)
            weights = {name: t.clone() for name, t in checkpoint_weights(ref.model)}
            del ref
        # loaded in place: graphs captured on the dummy weights read these
        runner.model.load_weights(runner.quant.adapt_weights(runner.model, weights.items()))  # type: ignore[union-attr]
        outputs[mode] = _generate(runner, runner.config, prompts, 16)
        if mode == "graphs":
            assert runner.graph_runner is not None and runner.graph_runner.num_replays > 0
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    eager, graphs = outputs["eager"], outputs["graphs"]
    shared_diffs: list[float] = []
    parted: list[tuple[str, int, float, float]] = []  # (request, step, gap in eager's ranks, gap in the graph's)
    for rid, want in eager.tokens.items():
        got = graphs.tokens[rid]
        assert len(got) == len(want) == 16 and len(eager.top[rid]) == len(graphs.top[rid]) == 16, rid
        split = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), 16)
        assert split > 0, f"{rid}: the first token (prefill, no graph) differs"
        shared_diffs += [abs(dict(eager.top[rid][i])[want[i]] - dict(graphs.top[rid][i])[want[i]])
                         for i in range(split)]
        if split < 16:  # how far each run ranks the other's token below its own (inf: not in its top 5)
            e, g = dict(eager.top[rid][split]), dict(graphs.top[rid][split])
            parted.append((rid, split, e[want[split]] - e.get(got[split], -math.inf),
                           g[got[split]] - g.get(want[split], -math.inf)))
    shared_diffs.sort()
    median = shared_diffs[len(shared_diffs) // 2]
    print(f"FP8 graphs + overlap vs eager: {len(shared_diffs)}/{16 * len(prompts)} steps on the same greedy path; "
          f"log-prob difference there median {median:.4f}, max {shared_diffs[-1]:.4f} nats; where paths part: "
          f"{parted}")
    assert shared_diffs[-1] < SHARED_STEP_MAX and median < SHARED_STEP_MEDIAN, shared_diffs
    # greedy paths may part only at a near-tie: each run ranks the other's token close below its own
    assert all(max(eager_gap, graph_gap) < NEAR_TIE for _, _, eager_gap, graph_gap in parted), parted


def test_fp8_checkpoint_on_the_gpu_matches_quantization_at_load(tmp_path) -> None:
    ref = ModelRunner(EngineConfig(device="cpu", dtype="float32", max_total_tokens=1024, load_format="dummy").resolve(),
                      PreparedModel("tiny", ModelConfig.from_hf_dict(HF_CONFIG), "dummy", None, None))
    weights = {name: t.clone() for name, t in checkpoint_weights(ref.model)}
    plain = write_checkpoint(tmp_path / "plain", weights)
    # quantized on the GPU, as the load quantizes: the CPU's division may round an FP8 value one ulp apart
    on_gpu = quantized({name: t.to(DEVICE) for name, t in weights.items()}, per_tensor=False)
    fp8_dir = write_checkpoint(tmp_path / "fp8", {name: t.cpu() for name, t in on_gpu.items()},
                               {"quant_method": "fp8", "activation_scheme": "dynamic"})
    from radixmesh.engine.loader import prepare_model

    def load(path: str, **overrides: object) -> ModelRunner:
        config = EngineConfig(model=path, device="cuda", dtype="bfloat16", max_total_tokens=4096,
                              disable_cuda_graph=True, **overrides).resolve()  # type: ignore[arg-type]
        return ModelRunner(config, prepare_model(path, "auto", progress=False))

    prompts = random_prompts(16, HF_CONFIG["vocab_size"], 3, 60, seed=2)  # type: ignore[arg-type]
    # one GEMM backend for both (see above): then the two loads run the same FP8 weights through the same kernels
    at_load = load(plain, quantization="fp8", fp8_gemm_backend="scaled-mm")
    published = load(fp8_dir, fp8_gemm_backend="scaled-mm")
    for (name, a), (_, b) in zip(at_load.model.named_parameters(), published.model.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                  b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name
    torch.testing.assert_close(prefill_logits(published, prompts), prefill_logits(at_load, prompts), atol=1e-3,
                               rtol=1e-3)


def test_fp8_decode_with_graphs_and_overlap_never_syncs() -> None:
    """The FP8 hot path (per-token quantization, FP8 GEMMs, the FP8 GEMV at batch 1, FP8 KV) under
    PyTorch's sync debug mode, as test_hot_path_gpu checks the bf16 one (values are not compared)."""
    sched, _ = make_scheduler(model_config(), **{**GPU_ENGINE, "dtype": "bfloat16"}, quantization="fp8",
                              kv_cache_dtype="fp8_e4m3")
    _warm_up(sched)
    reqs = make_requests(4, seed=1, max_new_tokens=24)
    for i, req in enumerate(reqs):  # lengths differ: the batch shrinks to 1 (the GEMV path)
        req.params = SamplingParams(max_new_tokens=10 + 12 * i, temperature=0.0, ignore_eos=True)
    _run_monitored(sched, reqs)


def test_fp8_kv_pool_holds_twice_the_tokens() -> None:
    """Last in the file: it sizes pools from free GPU memory, so earlier tests' memory must be released."""
    gc.collect()
    torch.cuda.empty_cache()
    sizes = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = _runner(disable_cuda_graph=True, max_total_tokens=None, kv_cache_dtype=kv)
        sizes[kv] = (runner.plan.max_total_tokens, runner.memory_info()["kv_bytes_per_token"])
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    print("KV tokens (bf16, fp8):", sizes)
    assert sizes["fp8_e4m3"][1] * 2 == sizes["auto"][1]
    assert 1.9 <= sizes["fp8_e4m3"][0] / sizes["auto"][0] <= 2.1
