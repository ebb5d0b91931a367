"""The MoE layer's small-batch path (`moe_small`) against the sorted path (`route_align` + grouped GEMMs) per M,
at real shapes: one JSON line per (shape, weights, M), the figures to pick `moe.SMALL_MAX_TOKENS` by.

    python -m radixmesh.kernels.bench_moe_small [--shapes qwen3-30b-a3b mixtral-8x7b] [--ms 1 2 4 8 16]
        [--weights bf16 fp8-w8a16] [--check] [--sweep] [--sweep-ms 1 4] [--sweep-weights bf16 fp8-w8a16]
    python -m radixmesh.kernels.bench_moe_small --table moe-small.jsonl

The calls are `bench_moe`'s (each its own tokens and router logits, alternating between two copies of the
weights: every call's experts come from memory). `small_us` / `sorted_us` time each path's whole layer in
one CUDA graph, with PDL as the model runs it (`small_fused_us`: the top-k inside the gate/up kernel, no
launch of its own); `topk_us`, `up_us`, `down_us` the small path's launches alone; `of_copy` is each path's
share of the bandwidth floor (active expert bytes / time / copy bandwidth). `--check`: each path's relative
error against `moe_ref`, the largest difference between the two, and whether the fused top-k gives the same
bits. `--sweep` times the small path's tiles (`block_n`, `block_k`, warps) per kernel, then the layer with
the best of each, top-k fused and not, and prints the winner as a `moe_config.SMALL_TUNED` entry.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from radixmesh.kernels._bench import copy_bandwidth_tb_s, print_table, run_info, time_us
from radixmesh.kernels.bench_moe import SHAPES, Bench, make_bench, make_layers
from radixmesh.kernels.moe import fused_moe
from radixmesh.kernels.moe_config import (
    SmallMoeConfig,
    SmallTiles,
    default_config,
    dtype_key,
    small_default_config,
)
from radixmesh.kernels.moe_ref import moe_ref, route_ref
from radixmesh.kernels.moe_small import small_down, small_gate_up, small_topk

WEIGHTS = ("bf16", "fp8-w8a16")
DEFAULT_MS = [1, 2, 4, 8, 16]
# (block_n, block_k, num_warps) per kernel, 3 stages; tiles of 1K..16K weight elements (gate/up: 2 x block_n
# rows; down: top_k x block_n rows, filtered per shape)
UP_TILES = [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512) for w in (4, 8)
            if 1024 <= 2 * bn * bk <= 16384]
DOWN_TILES = [(bn, bk, w) for bn in (1, 2, 4, 8, 16, 32) for bk in (64, 128, 256, 512) for w in (4, 8)]
TILE_ELEMENTS = (1024, 16384)


def _key(b: Bench) -> str:
    return dtype_key(torch.bfloat16, b.weights != "bf16", False)


def small_config(b: Bench) -> SmallMoeConfig:
    return small_default_config(b.shape.experts, b.shape.inter, b.shape.hidden, b.shape.top_k, _key(b),
                                torch.device("cuda"))


def layer_calls(b: Bench, path: str, cfg: SmallMoeConfig | None = None) -> list[Callable[[], object]]:
    """Each call's whole layer on `path` (the sorted path with `bench_moe`'s default tiles)."""
    sorted_cfg = default_config(b.shape.experts, b.shape.inter, b.shape.hidden, _key(b), b.m, b.shape.top_k,
                                torch.device("cuda"))
    return [functools.partial(fused_moe, x, lg, b.layer(i).w13, b.layer(i).w2, b.spec, w13_scale=b.layer(i).s13,
                              w2_scale=b.layer(i).s2, fp8_activations=False, config=sorted_cfg, small_config=cfg,
                              workspace=ws, out=out, path=path)
            for i, (x, lg, ws, out) in enumerate(zip(b.xs, b.logits, b.workspaces, b.outs))]


def _route(b: Bench) -> None:
    """Every call's top-k into its workspace (what the gate/up and down kernels read)."""
    for lg, ws in zip(b.logits, b.workspaces):
        small_topk(lg, b.spec, ws.routing.topk_ids[:b.m], ws.routing.topk_weights[:b.m])


def up_calls(b: Bench, tiles: SmallTiles) -> list[Callable[[], object]]:
    k = b.shape.top_k
    return [functools.partial(small_gate_up, x, ws.routing.topk_ids[:b.m], b.layer(i).w13, tiles,
                              ws.inter[:b.m * k], w13_scale=b.layer(i).s13)
            for i, (x, ws) in enumerate(zip(b.xs, b.workspaces))]


def down_calls(b: Bench, tiles: SmallTiles) -> list[Callable[[], object]]:
    k = b.shape.top_k
    return [functools.partial(small_down, ws.inter[:b.m * k], ws.routing.topk_ids[:b.m],
                              ws.routing.topk_weights[:b.m], b.layer(i).w2, tiles, out, w2_scale=b.layer(i).s2)
            for i, (ws, out) in enumerate(zip(b.workspaces, b.outs))]


def measure(b: Bench, copy_tb_s: float, check: bool) -> dict[str, object]:
    cfg = small_config(b)
    row: dict[str, object] = {"small_us": time_us(layer_calls(b, "small", cfg)),
                              "small_fused_us": time_us(layer_calls(b, "small", replace(cfg, fuse_topk=True))),
                              "sorted_us": time_us(layer_calls(b, "sorted"))}
    _route(b)
    row |= {"topk_us": time_us([functools.partial(small_topk, lg, b.spec, ws.routing.topk_ids[:b.m],
                                                  ws.routing.topk_weights[:b.m])
                                for lg, ws in zip(b.logits, b.workspaces)]),
            "up_us": time_us(up_calls(b, cfg.up)), "down_us": time_us(down_calls(b, cfg.down))}
    active = b.active_bytes()
    row |= {"active_mb": round(active / 1e6, 2), "copy_tb_s": round(copy_tb_s, 3)}
    for path in ("small", "sorted"):
        us = row[f"{path}_us"]
        if isinstance(us, float) and us > 0:
            row[f"{path}_of_copy"] = round(active / us / 1e6 / copy_tb_s, 3)
    if isinstance(row["small_us"], float) and isinstance(row["sorted_us"], float):
        row["speedup"] = round(row["sorted_us"] / row["small_us"], 3)
    if check:
        row |= check_paths(b)
    row["small_config"] = asdict(cfg)
    return row


def check_paths(b: Bench) -> dict[str, object]:
    """Each path's relative error against `moe_ref` (first call), their largest absolute difference, and whether
    the top-k fused into the gate/up kernel gives the small path's bits."""
    lay = b.layer(0)
    weights, ids = route_ref(b.logits[0], b.spec.top_k)
    want = moe_ref(b.xs[0], lay.w13, lay.w2, weights, ids, lay.s13, lay.s2).float()
    cfg = small_config(b)

    def first_call(path: str, small: SmallMoeConfig) -> torch.Tensor:
        got = layer_calls(b, path, small)[0]()  # (every call writes its own output buffer: copy it out)
        assert isinstance(got, torch.Tensor)
        return got.float().clone()

    small, sorted_, other = (first_call("small", cfg), first_call("sorted", cfg),
                             first_call("small", replace(cfg, fuse_topk=not cfg.fuse_topk)))
    return {"small_rel_err": round(float((small - want).norm() / want.norm()), 5),
            "sorted_rel_err": round(float((sorted_ - want).norm() / want.norm()), 5),
            "max_abs_diff": float((small - sorted_).abs().max()), "fuse_topk_equal": bool(torch.equal(small, other))}


def _best(calls_for: Callable[[SmallTiles], list[Callable[[], object]]],
          grid: list[tuple[int, int, int]]) -> tuple[float, SmallTiles] | None:
    timed = []
    for bn, bk, warps in grid:
        tiles = SmallTiles(bn, bk, warps, 3)
        us = time_us(calls_for(tiles))
        if us is not None:
            timed.append((us, tiles))
    return min(timed, key=lambda pair: pair[0]) if timed else None


def sweep(b: Bench) -> dict[str, object]:
    """The best tiles of each small-path kernel at this M, and the layer with both."""
    _route(b)
    up = _best(functools.partial(up_calls, b), UP_TILES)
    if up is None:
        return {"error": "no gate/up tiles ran"}
    for call in up_calls(b, up[1]):  # the down kernel reads these intermediates
        call()
    tk = 1 << (b.shape.top_k - 1).bit_length()
    grid = [t for t in DOWN_TILES if TILE_ELEMENTS[0] <= tk * t[0] * t[1] <= TILE_ELEMENTS[1]]
    down = _best(functools.partial(down_calls, b), grid)
    if down is None:
        return {"error": "no down tiles ran"}
    layers = {fuse: (time_us(layer_calls(b, "small", SmallMoeConfig(up[1], down[1], fuse))), fuse)
              for fuse in (False, True)}
    us, fuse = min((v for v in layers.values() if v[0] is not None), default=(None, False),
                   key=lambda v: v[0] or 0.0)
    cfg = SmallMoeConfig(up[1], down[1], fuse)
    key = (b.shape.experts, b.shape.inter, b.shape.hidden, b.shape.top_k, _key(b))
    return {"best_up_us": up[0], "best_down_us": down[0], "best_small_us": us,
            "unfused_us": layers[False][0], "fused_us": layers[True][0],
            "best": f"up {short(cfg.up)} / down {short(cfg.down)}{' / fused top-k' if fuse else ''}",
            "table_entry": f"{key!r}: {cfg!r},"}


def short(t: SmallTiles) -> str:
    return f"{t.block_n}x{t.block_k} w{t.num_warps}s{t.num_stages}"


COLUMNS = [("shape", "shape"), ("weights", "weights"), ("M", "m"), ("small_us", "small_us"),
           ("fused_us", "small_fused_us"), ("sorted_us", "sorted_us"), ("speedup", "speedup"), ("topk", "topk_us"),
           ("up", "up_us"), ("down", "down_us"), ("active_MB", "active_mb"), ("small_of_copy", "small_of_copy"),
           ("sorted_of_copy", "sorted_of_copy"), ("small_err", "small_rel_err"), ("max_diff", "max_abs_diff")]
SWEEP_COLUMNS = [("shape", "shape"), ("weights", "weights"), ("M", "m"), ("default_us", "default_small_us"),
                 ("best_us", "best_small_us"), ("best tiles", "best")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--ms", nargs="+", type=int, default=DEFAULT_MS, help="tokens per layer call")
    p.add_argument("--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    p.add_argument("--check", action="store_true", help="compare both paths with moe_ref and with each other")
    p.add_argument("--sweep", action="store_true", help="time the small path's tiles per kernel")
    p.add_argument("--sweep-ms", nargs="+", type=int, default=[1, 4], help="the Ms to sweep")
    p.add_argument("--sweep-weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS))
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print a table of earlier results and exit")
    args = p.parse_args(argv)
    if min(args.ms) < 1:
        p.error("--ms must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print_table(args.table, "moe-small", COLUMNS)
        print_table(args.table, "moe-small-sweep", SWEEP_COLUMNS)
        return 0
    if not torch.cuda.is_available():
        print("bench_moe_small needs a CUDA device", file=sys.stderr)
        return 2
    copy_tb_s = copy_bandwidth_tb_s()
    info = run_info("radixmesh.kernels.bench_moe_small")
    for name in args.shapes:
        layers = make_layers(SHAPES[name], 2)
        for weights in args.weights:
            for m in args.ms:
                b = make_bench(SHAPES[name], weights, m, layers["bf16" if weights == "bf16" else "fp8"])
                row = {"bench": "moe-small", "shape": name, "weights": weights, "m": m, "calls": len(b.xs),
                       **measure(b, copy_tb_s, args.check), **info}
                print(json.dumps(row), flush=True)
                if args.sweep and m in args.sweep_ms and weights in args.sweep_weights:
                    print(json.dumps({"bench": "moe-small-sweep", "shape": name, "weights": weights, "m": m,
                                      "default_small_us": row["small_us"], **sweep(b), **info}), flush=True)
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
