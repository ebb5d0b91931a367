"""Tile sweep of the MoE layer for one (shape, weights, M) of `bench_moe`: candidates for `moe_config.TUNED`.

For each candidate `block_m` (1 at decode sizes, 16, and larger ones up to twice the expected rows per
expert) the calls are placed once, then each GEMM's tiles are timed alone over the same calls; a block
size's layer time is its routing + best gate/up + best down + combine (+ quantizations under W8A8), and
the best block size's configuration is then timed as a whole layer. The result line carries the winner
as a `TUNED` entry to paste (`table_entry`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict

import torch

from radixmesh.kernels._bench import time_us
from radixmesh.kernels.bench_moe import Bench
from radixmesh.kernels.fp8_quant import quantize_rows
from radixmesh.kernels.moe_config import MoeConfig, MoeGemmConfig, dtype_key, m_bucket
from radixmesh.kernels.moe_gemm import moe_combine
from radixmesh.kernels.moe_routing import route_align

# (block_n, block_k, num_warps, num_stages): tensor-core tiles, and register tiles for blocks of one row
DOT_TILES = [(32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (64, 256, 4, 3),
             (64, 128, 8, 4), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3)]
REG_TILES = [(16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3)]
SMEM_BYTES = 200 * 1024  # of an H100/H200's 227 KiB, leaving room for the compiler's own


def block_m_candidates(rows_per_expert: float) -> list[int]:
    blocks = [1] if rows_per_expert <= 1 else []
    return [*blocks, 16, *(b for b in (32, 64, 128) if b <= 2 * rows_per_expert)]


def fits(block_m: int, tiles: tuple[int, int, int, int], elem_bytes: int, gated: bool) -> bool:
    """Whether the pipelined loads of a tile fit in shared memory."""
    cfg = MoeGemmConfig(tiles[0], tiles[1], 8, tiles[2], tiles[3])
    return cfg.smem_bytes(block_m, elem_bytes, elem_bytes, gated) <= SMEM_BYTES


def _best(b: Bench, calls_for: Callable[[MoeGemmConfig], list[Callable[[], object]]], block_m: int,
          gated: bool) -> tuple[float, MoeGemmConfig] | None:
    elem = 1 if b.weights == "fp8-w8a8" else 2
    timed = []
    for tiles in REG_TILES if block_m < 16 else DOT_TILES:
        if not fits(block_m, tiles, elem, gated):
            continue
        cfg = MoeGemmConfig(tiles[0], tiles[1], 8, tiles[2], tiles[3])
        us = time_us(calls_for(cfg))
        if us is not None:
            timed.append((us, cfg))
    return min(timed, key=lambda pair: pair[0]) if timed else None


def sweep(b: Bench) -> dict[str, object]:
    """The best configuration of this layer and batch, and what each block size reached."""
    shape = b.shape
    per_block: dict[int, dict[str, object]] = {}
    best: tuple[float, MoeConfig] | None = None
    for block_m in block_m_candidates(b.m * shape.top_k / shape.experts):
        als = b.align(block_m)
        fixed = [time_us([functools.partial(route_align, lg, b.spec, block_m, ws.routing)
                          for lg, ws in zip(b.logits, b.workspaces)]),
                 time_us([functools.partial(moe_combine, ws.y[:al.topk_ids.numel()], al, out)
                          for ws, al, out in zip(b.workspaces, als, b.outs)])]
        if b.a8:  # the per-token quantizations of the tokens and of the intermediate rows
            fixed.append(time_us([functools.partial(quantize_rows, x) for x in b.xs]))
            fixed.append(time_us([functools.partial(quantize_rows, ws.inter[:al.num_blocks * al.block_m])
                                  for ws, al in zip(b.workspaces, als)]))
        up = _best(b, functools.partial(b.up_calls, als), block_m, gated=True)
        down = _best(b, functools.partial(b.down_calls, als), block_m, gated=False)
        if up is None or down is None or None in fixed:
            continue
        total = sum(t for t in fixed if t is not None) + up[0] + down[0]
        per_block[block_m] = {"parts_us": round(total, 2), "up_us": up[0], "down_us": down[0]}
        if best is None or total < best[0]:
            best = (total, MoeConfig(block_m, up[1], down[1]))
    if best is None:
        return {"error": "no configuration ran"}
    cfg = best[1]
    key = (shape.experts, shape.inter, shape.hidden, dtype_key(torch.bfloat16, b.weights != "bf16", b.a8),
           m_bucket(b.m))
    return {"best_config": asdict(cfg), "best": short(cfg), "best_layer_us": time_us(b.layer_calls(cfg)),
            "per_block_m": per_block, "table_entry": f"{key!r}: {cfg!r},"}


def short(cfg: MoeConfig) -> str:
    """`bm16 up 64x128 w4s4 / down 64x128 w4s4`: block rows, then each GEMM's block_n x block_k, warps, stages."""
    def tiles(t: MoeGemmConfig) -> str:
        return f"{t.block_n}x{t.block_k} w{t.num_warps}s{t.num_stages}"

    return f"bm{cfg.block_m} up {tiles(cfg.up)} / down {tiles(cfg.down)}"
