"""The fused MoE layer at real shapes: time per layer and per part, bytes of the active experts, TB/s
against the device's copy bandwidth measured in the same run; one JSON line per (shape, weights, M).

    python -m radixmesh.kernels.bench_moe [--shapes qwen3-30b-a3b mixtral-8x7b] [--ms 1 2 4 8 16 32 64 128 256]
        [--weights bf16 fp8-w8a16 fp8-w8a8] [--check] [--sweep] [--sweep-ms 1 8 64 256]
    python -m radixmesh.kernels.bench_moe --table moe.jsonl     # a short table of a result file

Every call in a timed CUDA graph has its own tokens and router logits (so its own experts) and the calls
alternate between two copies of the layer's weights, enough calls that a graph reads several times the
L2 cache: each call's experts come from memory, as in a decode step through the model's layers. The
active bytes of a call are the weights (and FP8 scales) of the distinct experts its tokens chose;
`of_copy` = (active bytes / layer time) / copy bandwidth, the share of the bandwidth floor reached.
Parts are timed alone over the same calls: routing and placement (`route_us`; `route_torch_us` is
PyTorch's softmax + top-k + renormalization alone, for comparison), the two GEMMs, the combine, and
under W8A8 the two activation quantizations. `--sweep` times tile configurations per M (bench_moe_sweep).
Every figure here is the sorted path's; `bench_moe_small` times the small-batch path against it.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from radixmesh.kernels._bench import copy_bandwidth_tb_s, print_table, run_info, time_us
from radixmesh.kernels.bench_gemv import L2_SPAN_BYTES
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.moe import MoeWorkspace, fused_moe
from radixmesh.kernels.moe_config import MoeConfig, MoeGemmConfig, default_config, dtype_key
from radixmesh.kernels.moe_gemm import moe_combine, moe_down, moe_gate_up
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_routing import MoeAlignment, RouterSpec, route_align


@dataclass(frozen=True)
class MoeShape:
    """An MoE layer's dimensions and router."""

    hidden: int
    inter: int
    experts: int
    top_k: int
    renormalize: bool = True


SHAPES = {"qwen3-30b-a3b": MoeShape(2048, 768, 128, 8), "mixtral-8x7b": MoeShape(4096, 14336, 8, 2)}
WEIGHTS = ("bf16", "fp8-w8a16", "fp8-w8a8")
DEFAULT_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MAX_BLOCK_M = 128


@dataclass(frozen=True)
class Layer:
    """One copy of a layer's expert weights in one format."""

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None
    s2: torch.Tensor | None

    @property
    def bytes_per_expert(self) -> int:
        total = sum(t[0].numel() * t.element_size() for t in (self.w13, self.w2, self.s13, self.s2) if t is not None)
        return int(total)


def make_layers(shape: MoeShape, copies: int) -> dict[str, list[Layer]]:
    """`copies` random layers in bf16 and the same quantized to FP8 (per output channel, per expert)."""
    out: dict[str, list[Layer]] = {"bf16": [], "fp8": []}
    for seed in range(copies):
        torch.manual_seed(seed)
        w13 = torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(shape.experts, shape.hidden, shape.inter, device="cuda", dtype=torch.bfloat16) * 0.02
        out["bf16"].append(Layer(w13, w2, None, None))
        (q13, s13), (q2, s2) = (quantize_rows(w.view(-1, w.shape[2])) for w in (w13, w2))
        out["fp8"].append(Layer(q13.view(w13.shape), q2.view(w2.shape), s13.view(w13.shape[:2]), s2.view(w2.shape[:2])))
    return out


@dataclass
class Bench:
    """The calls of one (shape, weights, M): each its own tokens, logits, layer copy, workspace and output."""

    shape: MoeShape
    spec: RouterSpec
    weights: str
    m: int
    layers: list[Layer]
    xs: list[torch.Tensor]
    logits: list[torch.Tensor]
    workspaces: list[MoeWorkspace]
    outs: list[torch.Tensor]

    @property
    def a8(self) -> bool:
        return self.weights == "fp8-w8a8"

    def layer(self, i: int) -> Layer:
        return self.layers[i % len(self.layers)]

    def layer_calls(self, cfg: MoeConfig) -> list[Callable[[], object]]:
        return [functools.partial(fused_moe, x, lg, self.layer(i).w13, self.layer(i).w2, self.spec,
                                  w13_scale=self.layer(i).s13, w2_scale=self.layer(i).s2, fp8_activations=self.a8,
                                  config=cfg, workspace=ws, out=out, path="sorted")
                for i, (x, lg, ws, out) in enumerate(zip(self.xs, self.logits, self.workspaces, self.outs))]

    def align(self, block_m: int) -> list[MoeAlignment]:
        """Each call's placement with `block_m` (into its workspace), and under W8A8 its quantized tokens."""
        als = [route_align(lg, self.spec, block_m, ws.routing) for lg, ws in zip(self.logits, self.workspaces)]
        if self.a8:
            for x, ws in zip(self.xs, self.workspaces):
                assert ws.x_fp8 is not None
                quantize_rows(x, out=ws.x_fp8[0][:self.m], scale=ws.x_fp8[1][:self.m])
        return als

    def up_calls(self, als: list[MoeAlignment], tiles: MoeGemmConfig) -> list[Callable[[], object]]:
        calls: list[Callable[[], object]] = []
        for i, (x, ws, al) in enumerate(zip(self.xs, self.workspaces, als)):
            lay, rows = self.layer(i), al.num_blocks * al.block_m
            a, a_s = (ws.x_fp8[0][:self.m], ws.x_fp8[1][:self.m]) if ws.x_fp8 is not None and self.a8 else (x, None)
            calls.append(functools.partial(moe_gate_up, a, al, lay.w13, tiles, ws.inter[:rows], x_scale=a_s,
                                           w13_scale=lay.s13))
        return calls

    def down_calls(self, als: list[MoeAlignment], tiles: MoeGemmConfig) -> list[Callable[[], object]]:
        calls: list[Callable[[], object]] = []
        for i, (ws, al) in enumerate(zip(self.workspaces, als)):
            lay, rows = self.layer(i), al.num_blocks * al.block_m
            a, a_s = ws.inter[:rows], None
            if self.a8:
                assert ws.inter_fp8 is not None
                a, a_s = quantize_rows(a, out=ws.inter_fp8[0][:rows], scale=ws.inter_fp8[1][:rows])
            calls.append(functools.partial(moe_down, a, al, lay.w2, tiles, ws.y[:al.topk_ids.numel()],
                                           inter_scale=a_s, w2_scale=lay.s2))
        return calls

    def active_bytes(self) -> float:
        """Mean bytes of the distinct experts a call reads."""
        counts = [route_ref(lg, self.spec.top_k)[1].unique().numel() for lg in self.logits]
        return sum(counts) / len(counts) * self.layers[0].bytes_per_expert


def make_bench(shape: MoeShape, weights: str, m: int, layers: list[Layer]) -> Bench:
    per_expert = layers[0].bytes_per_expert
    expected = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** m) * per_expert
    num_calls = max(2, min(8, math.ceil(L2_SPAN_BYTES / expected)))
    spec = RouterSpec(shape.top_k, renormalize=shape.renormalize)
    fp8 = torch.float8_e4m3fn if weights == "fp8-w8a8" else None
    gen = torch.Generator(device="cuda").manual_seed(m)
    return Bench(shape, spec, weights, m, layers,
                 [torch.randn(m, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(num_calls)],
                 [torch.randn(m, shape.experts, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(num_calls)],
                 [MoeWorkspace.allocate(m, shape.top_k, shape.experts, shape.experts, shape.hidden, shape.inter,
                                        torch.bfloat16, torch.device("cuda"), MAX_BLOCK_M, fp8)
                  for _ in range(num_calls)],
                 [torch.empty(m, shape.hidden, device="cuda", dtype=torch.bfloat16) for _ in range(num_calls)])


def route_torch(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router in PyTorch ops (what a model without the fused kernel runs)."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def measure(b: Bench, cfg: MoeConfig, copy_tb_s: float, check: bool) -> dict[str, object]:
    """The layer and its parts with `cfg`."""
    layer_us = time_us(b.layer_calls(cfg))
    als = b.align(cfg.block_m)
    row: dict[str, object] = {
        "layer_us": layer_us,
        "route_us": time_us([functools.partial(route_align, lg, b.spec, cfg.block_m, ws.routing)
                             for lg, ws in zip(b.logits, b.workspaces)]),
        "route_torch_us": time_us([functools.partial(route_torch, lg, b.spec.top_k) for lg in b.logits]),
        "up_us": time_us(b.up_calls(als, cfg.up)), "down_us": time_us(b.down_calls(als, cfg.down)),
        "combine_us": time_us([functools.partial(moe_combine, ws.y[:al.topk_ids.numel()], al, out)
                               for ws, al, out in zip(b.workspaces, als, b.outs)]),
    }
    if b.a8:
        row["quant_us"] = time_us([functools.partial(quantize_rows, x) for x in b.xs])
    active = b.active_bytes()
    row |= {"active_mb": round(active / 1e6, 2), "copy_tb_s": round(copy_tb_s, 3)}
    if layer_us:
        row |= {"tb_s": round(active / layer_us / 1e6, 3), "of_copy": round(active / layer_us / 1e6 / copy_tb_s, 3)}
    if check:
        row["rel_err"] = check_layer(b, cfg)
    return row


def check_layer(b: Bench, cfg: MoeConfig) -> float:
    """Relative error of the first call's output against `moe_ref` (float32 on the GPU)."""
    lay = b.layer(0)
    got = b.layer_calls(cfg)[0]()
    assert isinstance(got, torch.Tensor)
    weights, ids = route_ref(b.logits[0], b.spec.top_k)
    want = moe_ref(b.xs[0], lay.w13, lay.w2, weights, ids, lay.s13, lay.s2, b.a8)
    return round(float((got.float() - want.float()).norm() / want.float().norm()), 5)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=DEFAULT_MS, help="tokens per layer call")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    p.add_argument("--check", action="store_true", help="compare each case's output with moe_ref first")
    p.add_argument("--sweep", action="store_true", help="time tile configurations per M (bf16 and --sweep-weights)")
    p.add_argument("--sweep-ms", nargs="+", type=int, default=None, help="the Ms to sweep (default: --ms)")
    p.add_argument("--sweep-weights", nargs="+", choices=WEIGHTS, default=["bf16"])
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print a table of earlier results and exit")
    args = p.parse_args(argv)
    if min(args.ms) < 1:
        p.error("--ms must be >= 1")
    return args


COLUMNS = [("shape", "shape"), ("weights", "weights"), ("M", "m"), ("layer_us", "layer_us"),
           ("route", "route_us"), ("route_torch", "route_torch_us"), ("up", "up_us"), ("down", "down_us"),
           ("combine", "combine_us"), ("active_MB", "active_mb"), ("TB/s", "tb_s"), ("of_copy", "of_copy"),
           ("rel_err", "rel_err")]
SWEEP_COLUMNS = [("shape", "shape"), ("weights", "weights"), ("M", "m"), ("default_us", "default_layer_us"),
                 ("best_us", "best_layer_us"), ("best config", "best")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print_table(args.table, "moe-layer", COLUMNS)
        print_table(args.table, "moe-sweep", SWEEP_COLUMNS)
        return 0
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA device", file=sys.stderr)
        return 2
    from radixmesh.kernels.bench_moe_sweep import sweep  # (imports this module)

    copy_tb_s = copy_bandwidth_tb_s()
    info = run_info("radixmesh.kernels.bench_moe")
    for name in args.shapes:
        shape = SHAPES[name]
        layers = make_layers(shape, 2)
        for weights in args.weights:
            for m in args.ms:
                b = make_bench(shape, weights, m, layers["bf16" if weights == "bf16" else "fp8"])
                cfg = default_config(shape.experts, shape.inter, shape.hidden,
                                     dtype_key(torch.bfloat16, weights != "bf16", b.a8), m, shape.top_k,
                                     torch.device("cuda"))
                row = {"bench": "moe-layer", "shape": name, "weights": weights, "m": m, "calls": len(b.xs),
                       **measure(b, cfg, copy_tb_s, args.check), "config": asdict(cfg), **info}
                print(json.dumps(row), flush=True)
                if args.sweep and weights in args.sweep_weights and m in (args.sweep_ms or args.ms):
                    print(json.dumps({"bench": "moe-sweep", "shape": name, "weights": weights, "m": m,
                                      "default_layer_us": row["layer_us"], **sweep(b), **info}), flush=True)
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
