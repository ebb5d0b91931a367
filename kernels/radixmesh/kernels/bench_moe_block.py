"""Qwen3-30B-A3B's MoE block at batch 1: the four launches of today (`gemv_add_rmsnorm_out`, `small_topk`,
`small_gate_up`, `small_down` with the tuned tiles) against `moe_block_decode`'s one, per layer.

    python -m radixmesh.kernels.bench_moe_block [--layers 48] [--check] [--sweep] [--trace]
    python -m radixmesh.kernels.bench_moe_block --table moe-block.jsonl

Every timed CUDA graph runs the block of `--layers` layers of distinct weights (1.2 GB each: every layer's
experts come from memory, as in a decode step), each layer with its own input row (so its own experts), all
sharing one workspace; `us` is the graph's time per layer, with PDL on and off. `active_mb` is a layer's mean
bytes read (router + the distinct experts chosen); `of_copy` = active bytes / time / copy bandwidth, the share
of the floor reached. The chain's launches are also timed alone (`norm_router_us`, `topk_us`, `up_us`,
`down_us`). `--check`: the block against the chain on layer 0 (exact `h`/`summed`, logits, the top-k of its own
logits, the outputs' relative error and whether they are bit-equal). `--sweep` times programs per SM (1, 2, 4)
x gate/up tiles, then x down tiles with the best gate/up ones, and prints the best as a `BLOCK_TUNED` entry.
`--trace`: launches one at a time (PDL off) with every program stamping its clocks at each step
(`moe_block.TRACE_POINTS`): per launch, microseconds from the first program's entry to the last program done
with each step (`*_last_us`) and to the first past each barrier (`barrier*_first_us`); medians over the launches.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from radixmesh.kernels._bench import copy_bandwidth_tb_s, print_table, run_info, time_us, trace_medians
from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.bench_moe import SHAPES
from radixmesh.kernels.gemv_norm_out import gemv_add_rmsnorm_out
from radixmesh.kernels.moe_block import TRACE_POINTS, MoeBlockWorkspace, moe_block_decode
from radixmesh.kernels.moe_config import MoeBlockConfig, block_default_config, small_default_config
from radixmesh.kernels.moe_routing import RouterSpec
from radixmesh.kernels.moe_small import small_down, small_gate_up, small_topk

SHAPE = SHAPES["qwen3-30b-a3b"]
EPS = 1e-6
UP_TILES = [(8, 256, 3), (8, 256, 4), (4, 512, 3), (16, 128, 3), (8, 512, 2)]  # (block_i, block_k, stages)
DOWN_TILES = [(4, 128, 3), (4, 128, 4), (2, 256, 3), (8, 64, 3), (4, 256, 2)]  # (block_h, block_k, stages)
CTAS = (1, 2, 4)


@dataclass
class Layers:
    """Every layer's weights and input row, and the buffers the calls share."""

    xs: list[torch.Tensor]
    residuals: list[torch.Tensor]
    norms: list[torch.Tensor]
    routers: list[torch.Tensor]
    w13s: list[torch.Tensor]
    w2s: list[torch.Tensor]
    spec: RouterSpec
    ws: MoeBlockWorkspace
    out: torch.Tensor

    def block_calls(self, cfg: MoeBlockConfig) -> list[Callable[[], object]]:
        return [functools.partial(moe_block_decode, x, r, nw, EPS, rw, w13, w2, self.spec, self.ws, out=self.out,
                                  config=cfg)
                for x, r, nw, rw, w13, w2 in zip(self.xs, self.residuals, self.norms, self.routers, self.w13s,
                                                 self.w2s)]

    def chain_calls(self) -> list[Callable[[], object]]:
        return [functools.partial(self.chain, i) for i in range(len(self.xs))]

    def chain(self, i: int) -> torch.Tensor:
        """Layer i as four launches (the small path's tuned tiles)."""
        tiles = small_default_config(SHAPE.experts, SHAPE.inter, SHAPE.hidden, SHAPE.top_k, "bf16",
                                     torch.device("cuda"))
        logits, h, _ = gemv_add_rmsnorm_out(self.xs[i], self.residuals[i], self.norms[i], EPS, self.routers[i])
        small_topk(logits, self.spec, self.ws.topk_ids, self.ws.topk_weights)
        small_gate_up(h, self.ws.topk_ids, self.w13s[i], tiles.up, self.ws.inter)
        return small_down(self.ws.inter, self.ws.topk_ids, self.ws.topk_weights, self.w2s[i], tiles.down, self.out)


def make_layers(num: int) -> Layers:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen) * scale

    e, h, i = SHAPE.experts, SHAPE.hidden, SHAPE.inter
    layers = range(num)
    return Layers([randn(1, h) for _ in layers], [randn(1, h) for _ in layers],
                  [1 + randn(h, scale=0.1) for _ in layers], [randn(e, h, scale=0.02) for _ in layers],
                  [randn(e, 2 * i, h, scale=0.02) for _ in layers], [randn(e, h, i, scale=0.02) for _ in layers],
                  RouterSpec(SHAPE.top_k),
                  MoeBlockWorkspace.allocate(e, SHAPE.top_k, i, h, torch.bfloat16, torch.device("cuda")),
                  torch.empty(1, h, device="cuda", dtype=torch.bfloat16))


def active_bytes(lay: Layers) -> int:
    """A layer's bytes read: its router, its row's top-k experts (always distinct for one row) and the row vectors."""
    per_expert = (lay.w13s[0][0].numel() + lay.w2s[0][0].numel()) * 2
    return lay.routers[0].numel() * 2 + SHAPE.top_k * per_expert + 5 * SHAPE.hidden * 2


def default_config() -> MoeBlockConfig:
    return block_default_config(SHAPE.experts, SHAPE.inter, SHAPE.hidden, SHAPE.top_k, torch.device("cuda"))


def timed(lay: Layers, calls: list[Callable[[], object]], pdl: bool = True) -> float | None:
    """`time_us` of `calls`, after one eager call showed the grid co-resident (a wait that timed out would make
    every replay take seconds)."""
    set_pdl(pdl)
    try:
        calls[0]()
        torch.cuda.synchronize()
    except Exception as exc:  # (a tile over a limit: reported, the sweep goes on)
        print(f"# skipped: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        set_pdl(True)
        return None
    if lay.ws.timed_out():
        raise SystemExit("moe_block: a grid barrier timed out (the programs were not all resident)")
    try:
        return time_us(calls)
    finally:
        set_pdl(True)


def measure(lay: Layers, copy_tb_s: float) -> list[dict[str, object]]:
    """The chain and the block with the default configuration, PDL on and off, and the chain's parts."""
    active = active_bytes(lay)
    rows: list[dict[str, object]] = []
    for path, calls in (("chain", lay.chain_calls()), ("block", lay.block_calls(default_config()))):
        for pdl in (True, False):
            us = timed(lay, calls, pdl)
            rows.append({"path": path, "pdl": pdl, "us": us,
                         "of_copy": round(active / us / 1e6 / copy_tb_s, 3) if us else None})
    rows[0] |= chain_parts(lay)
    rows[-2]["config"] = asdict(default_config())
    return rows


def chain_parts(lay: Layers) -> dict[str, object]:
    tiles = small_default_config(SHAPE.experts, SHAPE.inter, SHAPE.hidden, SHAPE.top_k, "bf16", torch.device("cuda"))
    n, ws = range(len(lay.xs)), lay.ws
    logits = [gemv_add_rmsnorm_out(lay.xs[i], lay.residuals[i], lay.norms[i], EPS, lay.routers[i])[0] for i in n]
    return {"norm_router_us": time_us([functools.partial(gemv_add_rmsnorm_out, lay.xs[i], lay.residuals[i],
                                                         lay.norms[i], EPS, lay.routers[i]) for i in n]),
            "topk_us": time_us([functools.partial(small_topk, lg, lay.spec, ws.topk_ids, ws.topk_weights)
                                for lg in logits]),
            "up_us": time_us([functools.partial(small_gate_up, lay.xs[i], ws.topk_ids, lay.w13s[i], tiles.up,
                                                ws.inter) for i in n]),
            "down_us": time_us([functools.partial(small_down, ws.inter, ws.topk_ids, ws.topk_weights, lay.w2s[i],
                                                  tiles.down, lay.out) for i in n])}


def check(lay: Layers) -> dict[str, object]:
    """Layer 0's block against its chain."""
    args = (lay.xs[0], lay.residuals[0], lay.norms[0], EPS, lay.routers[0])
    logits, h_want, summed_want = gemv_add_rmsnorm_out(*args)
    out, h, summed = moe_block_decode(*args, lay.w13s[0], lay.w2s[0], lay.spec, lay.ws, config=default_config())
    block_logits, ids = lay.ws.logits.clone(), lay.ws.topk_ids.clone()
    timed_out = lay.ws.timed_out()
    own_ids = torch.empty_like(ids)
    small_topk(block_logits, lay.spec, own_ids, torch.empty_like(lay.ws.topk_weights))
    chain_out = lay.chain(0).clone()  # (its top-k: of the router GEMV's logits)
    same_experts = torch.equal(lay.ws.topk_ids, ids)
    return {"timed_out": timed_out, "h_equal": torch.equal(h, h_want), "summed_equal": torch.equal(summed, summed_want),
            "logits_max_diff": float((block_logits.float() - logits.float()).abs().max()),
            "ids_equal_own_topk": torch.equal(ids, own_ids), "same_experts_as_chain": same_experts,
            "rel_err_vs_chain": round(float((out.float() - chain_out.float()).norm() / chain_out.float().norm()), 6),
            "bit_equal_to_chain": same_experts and torch.equal(out, chain_out)}


def sweep(lay: Layers) -> list[dict[str, object]]:
    """Programs per SM x gate/up tiles (the default down tiles), then x down tiles (the best gate/up ones)."""
    timed_cfgs: list[tuple[str, float | None, MoeBlockConfig]] = []
    for bi, bk, stages in UP_TILES:
        for ctas in CTAS:
            cfg = replace(default_config(), block_i=bi, up_block_k=bk, up_stages=stages, ctas_per_sm=ctas)
            timed_cfgs.append(("up", timed(lay, lay.block_calls(cfg)), cfg))
    ran = [(us, cfg) for _, us, cfg in timed_cfgs if us is not None]
    best_up = min(ran, key=lambda r: r[0])[1] if ran else default_config()
    for bh, bk, stages in DOWN_TILES:
        for ctas in CTAS:
            cfg = replace(best_up, block_h=bh, down_block_k=bk, down_stages=stages, ctas_per_sm=ctas)
            timed_cfgs.append(("down", timed(lay, lay.block_calls(cfg)), cfg))
    rows: list[dict[str, object]] = [{"part": part, "us": us, "config": asdict(cfg)} for part, us, cfg in timed_cfgs]
    ran = [(us, cfg) for _, us, cfg in timed_cfgs if us is not None]
    if ran:
        us, cfg = min(ran, key=lambda r: r[0])
        key = (SHAPE.experts, SHAPE.inter, SHAPE.hidden, SHAPE.top_k)
        rows.append({"part": "best", "us": us, "config": asdict(cfg), "table_entry": f"{key!r}: {cfg!r},"})
    return rows


COLUMNS = [("path", "path"), ("pdl", "pdl"), ("us", "us"), ("active_MB", "active_mb"), ("of_copy", "of_copy"),
           ("norm_router", "norm_router_us"), ("topk", "topk_us"), ("up", "up_us"), ("down", "down_us")]
SWEEP_COLUMNS = [("part", "part"), ("us", "us"), ("config", "config"), ("entry", "table_entry")]


def trace(lay: Layers, cfg: MoeBlockConfig, rounds: int = 4) -> dict[str, object]:
    """When each step of a launch ends (see the module docstring), medians over `rounds` x the layers."""
    layers = list(zip(lay.xs, lay.residuals, lay.norms, lay.routers, lay.w13s, lay.w2s))
    done = [0]

    def launch(stamps: torch.Tensor) -> None:
        x, r, nw, rw, w13, w2 = layers[done[0] % len(layers)]
        done[0] += 1
        moe_block_decode(x, r, nw, EPS, rw, w13, w2, lay.spec, lay.ws, out=lay.out, config=cfg, trace=stamps)

    set_pdl(False)
    try:
        return trace_medians(launch, TRACE_POINTS, rounds * len(layers)) | {"config": asdict(cfg)}
    finally:
        set_pdl(True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48, help="layers of distinct weights per graph (1.2 GB each)")
    p.add_argument("--check", action="store_true", help="compare the block with the chain on layer 0 first")
    p.add_argument("--sweep", action="store_true", help="time programs per SM and tiles")
    p.add_argument("--trace", action="store_true", help="when each step of a launch ends (PDL off)")
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print a table of earlier results and exit")
    args = p.parse_args(argv)
    if args.table:
        print_table(args.table, "moe-block", COLUMNS)
        print_table(args.table, "moe-block-sweep", SWEEP_COLUMNS)
        return 0
    if not torch.cuda.is_available():
        print("bench_moe_block needs a CUDA device", file=sys.stderr)
        return 2
    copy_tb_s = copy_bandwidth_tb_s()
    info = run_info("radixmesh.kernels.bench_moe_block") | {"layers": args.layers, "copy_tb_s": round(copy_tb_s, 3)}
    lay = make_layers(args.layers)
    info["active_mb"] = round(active_bytes(lay) / 1e6, 2)
    if args.check:
        print(json.dumps({"bench": "moe-block-check", **check(lay), **info}), flush=True)
    if args.trace:
        print(json.dumps({"bench": "moe-block-trace", **trace(lay, default_config()), **info}), flush=True)
    for row in measure(lay, copy_tb_s):
        print(json.dumps({"bench": "moe-block", **row, **info}), flush=True)
    if args.sweep:
        for row in sweep(lay):
            print(json.dumps({"bench": "moe-block-sweep", **row, **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
