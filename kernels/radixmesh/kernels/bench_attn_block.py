"""The attention half of a batch-1 decode layer: today's launches (`gemv_add_rmsnorm` for q/k/v, the decode
split kernel with the rotary and the KV store, its merge, the o `gemv`) against `attn_block_decode`'s one.

    python -m radixmesh.kernels.bench_attn_block [--shape qwen3-30b-a3b] [--context 1024] [--check] [--sweep]
        [--trace]
    python -m radixmesh.kernels.bench_attn_block --table attn-block.jsonl

Every timed CUDA graph runs `--layers` layers of distinct weights and KV pools (each request `--context` slots
long, the new token's slot last), all sharing one workspace; `us` is the graph's time per layer with PDL on (and
off). `weights_mb` is a layer's q/k/v and o weights, `kv_mb` its KV read; `of_copy` = their sum / time / copy
bandwidth. `--check`: layer 0's block against its chain (relative error of the output, `summed` equal, the new
K/V row). `--sweep`: programs per SM, splits, tiles and stages. `--trace`: launches one at a
time (PDL off), every program stamping its clocks after each step (`attn_block.TRACE_POINTS`): medians of the
microseconds from the first program's entry to the last program done with each step.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch

from radixmesh.kernels._bench import copy_bandwidth_tb_s, print_table, run_info, time_us, trace_medians
from radixmesh.kernels._pdl import set_pdl
from radixmesh.kernels.attn_block import (
    TRACE_POINTS,
    AttnBlockConfig,
    AttnBlockWorkspace,
    BlockRope,
    attn_block_decode,
)
from radixmesh.kernels.decode_attention import (
    DecodeScratch,
    choose_num_kv_splits,
    decode_attention_fwd,
    get_num_sms,
)
from radixmesh.kernels.decode_rope import DecodeRope
from radixmesh.kernels.gemv import gemv
from radixmesh.kernels.gemv_fused import gemv_add_rmsnorm

EPS = 1e-6
MAX_SPLITS = 64
"""The workspace's splits (a configuration uses up to these)."""


class Shape(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool


SHAPES = {"qwen3-30b-a3b": Shape(2048, 32, 4, 128, True), "qwen3-8b": Shape(4096, 32, 8, 128, True)}
"""Qwen3 shapes: the model's chain runs the rotary inside the split kernel only with q/k norms."""


@dataclass
class Layers:
    """Every layer's weights, KV pool and input row, and the buffers the calls share."""

    shape: Shape
    context: int
    xs: list[torch.Tensor]
    residuals: list[torch.Tensor]
    norms: list[torch.Tensor]
    w_qkv: list[torch.Tensor]
    w_o: list[torch.Tensor]
    k_bufs: list[torch.Tensor]
    v_bufs: list[torch.Tensor]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    ws: AttnBlockWorkspace
    scratch: DecodeScratch
    splits: int
    attn: torch.Tensor
    out: torch.Tensor

    def rope(self) -> BlockRope:
        qk = self.shape.qk_norm
        return BlockRope(self.q_norm if qk else None, self.k_norm if qk else None, EPS, self.cos, self.sin,
                         self.positions, self.loc)

    def block(self, i: int, cfg: AttnBlockConfig, trace: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return attn_block_decode(self.xs[i], self.residuals[i], self.norms[i], EPS, self.w_qkv[i], self.w_o[i],
                                 self.rope(), self.k_bufs[i], self.v_bufs[i], self.indptr, self.indices,
                                 self.shape.head_dim ** -0.5, self.ws, out=self.out, config=cfg, trace=trace)

    def chain(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i as the model runs it today: q/k/v with the norm, the split kernel with the rotary, merge, o."""
        s = self.shape
        qkv, summed = gemv_add_rmsnorm(self.xs[i], self.residuals[i], self.norms[i], EPS, self.w_qkv[i])
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(1, s.heads, s.head_dim)
        rope = DecodeRope(k.view(1, s.kv_heads, s.head_dim), v.view(1, s.kv_heads, s.head_dim),
                          self.q_norm, self.k_norm, EPS, self.cos, self.sin, self.positions, self.loc)
        decode_attention_fwd(q, self.k_bufs[i], self.v_bufs[i], self.attn, self.indptr, self.indices,
                             s.head_dim ** -0.5, self.splits, self.scratch, rope=rope)
        return gemv(self.attn.view(1, -1), self.w_o[i], out=self.out), summed

    def calls(self, cfg: AttnBlockConfig | None) -> list[Callable[[], object]]:
        if cfg is None:
            return [functools.partial(self.chain, i) for i in range(len(self.xs))]
        return [functools.partial(self.block, i, cfg) for i in range(len(self.xs))]


def make_layers(shape: Shape, num: int, context: int, splits: int) -> Layers:
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")

    def randn(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*dims, device=dev, dtype=torch.bfloat16, generator=gen) * scale

    h, hq, hkv, d, _ = shape
    rows = (hq + 2 * hkv) * d
    slots = context + 64
    layers = range(num)
    pos = torch.arange(8192, dtype=torch.float32, device=dev)[:, None]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d))
    indices = torch.randperm(slots, device=dev, generator=gen)[:context].to(torch.int32)
    return Layers(shape, context, [randn(1, h) for _ in layers], [randn(1, h) for _ in layers],
                  [1 + randn(h, scale=0.1) for _ in layers], [randn(rows, h, scale=h ** -0.5) for _ in layers],
                  [randn(h, hq * d, scale=(hq * d) ** -0.5) for _ in layers],
                  [randn(slots, hkv, d) for _ in layers], [randn(slots, hkv, d) for _ in layers],
                  1 + randn(d, scale=0.1), 1 + randn(d, scale=0.1), torch.cos(pos * inv), torch.sin(pos * inv),
                  torch.tensor([context - 1], device=dev), indices[-1:].to(torch.int64),
                  torch.tensor([0, context], dtype=torch.int32, device=dev), indices,
                  AttnBlockWorkspace.allocate(hq, hkv, d, splits, torch.bfloat16, dev),
                  DecodeScratch.allocate(1, hq, d, 64, dev),
                  choose_num_kv_splits(1, hkv, context, get_num_sms(dev)),
                  torch.empty(1, hq, d, device=dev, dtype=torch.bfloat16), torch.empty(1, h, device=dev,
                                                                                      dtype=torch.bfloat16))


def layer_bytes(lay: Layers) -> tuple[int, int]:
    """(weight bytes, KV bytes) a layer reads."""
    s = lay.shape
    return (lay.w_qkv[0].numel() + lay.w_o[0].numel()) * 2, 2 * lay.context * s.kv_heads * s.head_dim * 2


def timed(lay: Layers, cfg: AttnBlockConfig | None, pdl: bool = True) -> float | None:
    set_pdl(pdl)
    try:
        calls = lay.calls(cfg)
        try:
            calls[0]()
            torch.cuda.synchronize()
        except Exception as exc:  # (a configuration over a limit: reported, the sweep goes on)
            print(f"# skipped: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            return None
        if lay.ws.timed_out():
            raise SystemExit("attn_block: a grid barrier timed out (the programs were not all resident)")
        return time_us(calls)
    finally:
        set_pdl(True)


def measure(lay: Layers, cfg: AttnBlockConfig, copy_tb_s: float) -> list[dict[str, object]]:
    weights, kv = layer_bytes(lay)
    rows: list[dict[str, object]] = []
    for path, c in (("chain", None), ("block", cfg)):
        for pdl in (True, False):
            us = timed(lay, c, pdl)
            rows.append({"path": path, "pdl": pdl, "us": us,
                         "of_copy": round((weights + kv) / us / 1e6 / copy_tb_s, 3) if us else None,
                         "config": asdict(c) if c else {"num_kv_splits": lay.splits}})
    return rows


def check(lay: Layers, cfg: AttnBlockConfig) -> dict[str, object]:
    """Layer 0's block against its chain (each from the same pool: the new row is written by both)."""
    want, want_summed = (t.clone() for t in lay.chain(0))
    new_k = lay.k_bufs[0][lay.loc].clone()
    out, summed = (t.clone() for t in lay.block(0, cfg))
    timed_out = lay.ws.timed_out()
    return {"timed_out": timed_out, "summed_equal": torch.equal(summed, want_summed),
            "new_k_max_diff": float((lay.k_bufs[0][lay.loc].float() - new_k.float()).abs().max()),
            "rel_err_vs_chain": round(float((out.float() - want.float()).norm() / want.float().norm()), 6),
            "counters_zero": lay.ws.sync[:2].tolist() == [0, 0]}


def sweep(lay: Layers, base: AttnBlockConfig) -> list[dict[str, object]]:
    cfgs = [replace(base, ctas_per_sm=c) for c in (1, 2, 3)]
    cfgs += [replace(base, num_splits=s) for s in (8, 16, MAX_SPLITS)]
    cfgs += [replace(base, qkv_block_r=r, qkv_block_k=k, o_block_r=r, o_block_k=k) for r, k in ((8, 256), (2, 1024))]
    cfgs += [replace(base, num_stages=s) for s in (2, 4)]
    return [{"us": timed(lay, c), "config": asdict(c)} for c in cfgs]


def trace(lay: Layers, cfg: AttnBlockConfig, rounds: int = 4) -> dict[str, object]:
    """When each step of a launch ends, medians over `rounds` x the layers (PDL off)."""
    done = [0]

    def launch(stamps: torch.Tensor) -> None:
        lay.block(done[0] % len(lay.xs), cfg, trace=stamps)
        done[0] += 1

    set_pdl(False)
    try:
        return trace_medians(launch, TRACE_POINTS, rounds * len(lay.xs)) | {"config": asdict(cfg)}
    finally:
        set_pdl(True)


COLUMNS = [("path", "path"), ("pdl", "pdl"), ("us", "us"), ("of_copy", "of_copy"), ("config", "config")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=48, help="layers of distinct weights and pools per graph")
    p.add_argument("--context", type=int, default=1024, help="the request's slots, the new token's included")
    p.add_argument("--check", action="store_true", help="compare the block with the chain on layer 0 first")
    p.add_argument("--sweep", action="store_true", help="time programs per SM, splits, tiles and stages")
    p.add_argument("--trace", action="store_true", help="when each step of a launch ends (PDL off)")
    p.add_argument("--table", nargs="+", metavar="JSONL", help="print a table of earlier results and exit")
    args = p.parse_args(argv)
    if args.table:
        print_table(args.table, "attn-block", COLUMNS)
        print_table(args.table, "attn-block-sweep", [("us", "us"), ("config", "config")])
        return 0
    if not torch.cuda.is_available():
        print("bench_attn_block needs a CUDA device", file=sys.stderr)
        return 2
    cfg = AttnBlockConfig()
    copy_tb_s = copy_bandwidth_tb_s()
    lay = make_layers(SHAPES[args.shape], args.layers, args.context, MAX_SPLITS)
    weights, kv = layer_bytes(lay)
    info = run_info("radixmesh.kernels.bench_attn_block") | {
        "shape": args.shape, "layers": args.layers, "context": args.context, "copy_tb_s": round(copy_tb_s, 3),
        "weights_mb": round(weights / 1e6, 2), "kv_mb": round(kv / 1e6, 2)}
    if args.check:
        print(json.dumps({"bench": "attn-block-check", **check(lay, cfg), **info}), flush=True)
    if args.trace:
        print(json.dumps({"bench": "attn-block-trace", **trace(lay, cfg), **info}), flush=True)
    for row in measure(lay, cfg, copy_tb_s):
        print(json.dumps({"bench": "attn-block", **row, **info}), flush=True)
    if args.sweep:
        for row in sweep(lay, cfg):
            print(json.dumps({"bench": "attn-block-sweep", **row, **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
