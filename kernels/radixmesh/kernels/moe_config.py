"""Tile configurations of the MoE GEMMs, per layer shape, weight format and batch size.

A layer's configuration is its rows per block (`block_m`, shared by both GEMMs: the assignments are placed
in blocks once) and each GEMM's tiles. `TUNED` is keyed by `(E, N, K, dtype, M bucket)`: E the experts in
the weights (local ones under expert parallelism), N the moe intermediate size, K the hidden size, dtype one
of `DTYPE_KEYS`, and the batch's token count rounded up to a bucket. `bench_moe --sweep` prints the best
entry per M, in this form, from a GPU run. Elsewhere `default_config` picks by the expected rows per
expert; tiles are never autotuned at run time (a new M must not start a benchmark in a CUDA-graph capture).
The small-batch path (`moe_small`) and the one-launch block of one token (`moe_block`) keep their own tiles here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HOPPER_SMEM_BYTES = 232448
"""Shared memory one program may use on an H100/H200 (227 KiB, the opt-in limit)."""
DTYPE_KEYS = ("bf16", "fp16", "fp32", "fp8-w8a16", "fp8-w8a8")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tiles of one grouped GEMM."""

    block_n: int
    """Output features per program (of the intermediate size for gate/up: each program computes both halves)."""
    block_k: int
    """Reduction step."""
    group_m: int = 8
    """Row blocks whose programs run side by side over the same weight tiles (L2 reuse)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Loads in flight in the K loop."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "group_m"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2, got {value}"
        assert self.block_n >= 16 and self.block_k >= 16, f"block_n, block_k must be >= 16: {self}"
        assert self.num_warps in (1, 2, 4, 8, 16) and 1 <= self.num_stages <= 8, f"bad warps/stages: {self}"

    def smem_bytes(self, block_m: int, a_bytes: int, w_bytes: int, gated: bool) -> int:
        """Shared memory of the K loop's pipelined loads on the tensor-core path: `num_stages` copies of the
        activation tile `[block_m, block_k]` and of the weight tile `[block_k, block_n]` (two when gated)."""
        weights = (2 if gated else 1) * self.block_k * self.block_n * w_bytes
        return self.num_stages * (block_m * self.block_k * a_bytes + weights)


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of one MoE layer call."""

    block_m: int
    """Rows per block (each block holds one expert's assignments): 1..8 run without tensor cores, 16+ with."""
    up: MoeGemmConfig
    """The gate/up GEMM's tiles."""
    down: MoeGemmConfig
    """The down GEMM's tiles."""

    def __post_init__(self) -> None:
        assert 1 <= self.block_m <= 256 and self.block_m & (self.block_m - 1) == 0, (
            f"block_m must be a power of 2 in [1, 256], got {self.block_m}")


TUNED: dict[tuple[int, int, int, str, int], MoeConfig] = {
    # (E, N, K, dtype, M bucket) -> the best of `bench_moe --sweep` (empty until a GPU run fills it)
}


def dtype_key(dtype: torch.dtype, fp8_weights: bool, fp8_activations: bool) -> str:
    """The `DTYPE_KEYS` entry of a layer: FP8 weights with or without quantized activations, else the dtype."""
    if fp8_weights:
        return "fp8-w8a8" if fp8_activations else "fp8-w8a16"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def m_bucket(m: int) -> int:
    """The smallest bucket holding `m` tokens (the largest bucket beyond it)."""
    return next((b for b in M_BUCKETS if b >= m), M_BUCKETS[-1])


def default_config(num_experts: int, inter: int, hidden: int, key: str, m: int, top_k: int,
                   device: torch.device) -> MoeConfig:
    """The tuned configuration of this layer and batch, else one chosen by the expected rows per expert:
    few rows (decode) favour narrow N tiles (many programs streaming weights), many rows square tiles. Every
    choice fits `HOPPER_SMEM_BYTES` (float32 takes half the K of 16-bit types, FP8 twice)."""
    assert key in DTYPE_KEYS, f"dtype key {key!r} not one of {DTYPE_KEYS}"
    tuned = TUNED.get((num_experts, inter, hidden, key, m_bucket(m)))
    if tuned is not None:
        return tuned
    if device.type == "cpu":  # the interpreter: small tiles, few ops per program
        small = MoeGemmConfig(16, 32, 4, 1, 1)
        return MoeConfig(16, small, small)
    wide_k = {"fp8-w8a16": 256, "fp8-w8a8": 256, "fp32": 64}.get(key, 128)  # the same bytes of K per tile
    rows = m * top_k / num_experts
    if rows <= 16:
        tiles = MoeGemmConfig(64, wide_k, 8, 4, 4)
        return MoeConfig(16, tiles, tiles)
    if rows <= 64:
        tiles = MoeGemmConfig(128, wide_k // 2, 8, 4, 4)
        return MoeConfig(32 if rows <= 32 else 64, tiles, tiles)
    tiles = MoeGemmConfig(128, 32 if key == "fp32" else 64, 8, 8, 3)
    return MoeConfig(128 if rows >= 256 else 64, tiles, tiles)


# ---- the small-batch path (moe_small) ---------------------------------------------------------------

@dataclass(frozen=True)
class SmallTiles:
    """Tiles of one kernel of the small-batch path (register GEMVs, one program per assignment or token)."""

    block_n: int
    """Output features per program (gate/up: intermediate features, each with its gate and up row; down: hidden)."""
    block_k: int
    """Reduction step (contiguous weight elements per row per step)."""
    num_warps: int = 4
    """Warps per program."""
    num_stages: int = 3
    """Loads in flight in the K loop."""

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2, got {value}"
        assert self.block_k >= 16, f"block_k must be >= 16: {self}"
        assert self.num_warps in (1, 2, 4, 8, 16) and 1 <= self.num_stages <= 8, f"bad warps/stages: {self}"


@dataclass(frozen=True)
class SmallMoeConfig:
    """Tiles of the small-batch path's two GEMV kernels."""

    up: SmallTiles
    """The gate/up kernel's (grid: assignments x intermediate tiles)."""
    down: SmallTiles
    """The down kernel's (grid: tokens x hidden tiles; each program holds all top-k experts' tiles)."""
    fuse_topk: bool = False
    """Route in the gate/up kernel (each program computes its token's top-k) instead of a top-k launch before it."""


SMALL_TUNED: dict[tuple[int, int, int, int, str], SmallMoeConfig] = {
    # (E, N, K, top_k, dtype) -> the best of `bench_moe_small --sweep` at M = 1 (batch-1 decode). Qwen3-30B-A3B on an
    # H200 (docs/benchmarks/h200-moe-small-2026-11-29.jsonl): 25.95 us a layer against 26.98 at the default tiles;
    # M = 2, 4 and 8 are not slower with it (h200-moe-small-tuned-2026-11-29m.jsonl)
    (128, 768, 2048, 8, "bf16"): SmallMoeConfig(SmallTiles(8, 256, 4, 3), SmallTiles(4, 128, 4, 3)),
}


def small_default_config(num_experts: int, inter: int, hidden: int, top_k: int, key: str,
                         device: torch.device) -> SmallMoeConfig:
    """The tuned tiles of this layer's small-batch path, else GEMV-like ones: few rows per program (many
    programs streaming weights), K tiles of 512 bytes per row (twice the elements for FP8); the down kernel's
    3-D tile `[top_k, block_n, block_k]` keeps about as many elements as the gate/up one's `[2, block_n,
    block_k]`."""
    assert key in ("bf16", "fp16", "fp32", "fp8-w8a16"), f"the small-batch path does not run {key!r} layers"
    tuned = SMALL_TUNED.get((num_experts, inter, hidden, top_k, key))
    if tuned is not None:
        return tuned
    if device.type == "cpu":  # the interpreter: small tiles, few ops per program
        return SmallMoeConfig(SmallTiles(4, 32, 1, 1), SmallTiles(4, 32, 1, 1))
    block_k = {"fp8-w8a16": 512, "fp32": 128}.get(key, 256)
    tk = 1 << (top_k - 1).bit_length()
    return SmallMoeConfig(SmallTiles(8, block_k, 4, 3), SmallTiles(max(1, 16 // tk), block_k, 4, 3))


# ---- the one-launch block of one token (moe_block) ------------------------------------------------------

@dataclass(frozen=True)
class MoeBlockConfig:
    """Tiles of the one-launch MoE block (`moe_block.moe_block_decode`) and its programs per SM."""

    block_i: int = 8
    """Intermediate features per gate/up unit (each with its gate row and its up row)."""
    up_block_k: int = 256
    """Gate/up reduction step (hidden features per load)."""
    block_h: int = 4
    """Hidden features per down unit (each over all top-k experts)."""
    down_block_k: int = 128
    """Down reduction step (intermediate features per load)."""
    num_warps: int = 4
    """Warps per program."""
    up_stages: int = 3
    """Loads in flight in the gate/up loop."""
    down_stages: int = 3
    """Loads in flight in the down loop."""
    ctas_per_sm: int = 2
    """Programs per SM (P = SMs x this), lowered by the launcher to what fits."""

    def __post_init__(self) -> None:
        for name in ("block_i", "up_block_k", "block_h", "down_block_k"):
            value = getattr(self, name)
            assert value >= 1 and value & (value - 1) == 0, f"{name} must be a power of 2, got {value}"
        assert self.up_block_k >= 16 and self.down_block_k >= 16, f"block_k must be >= 16: {self}"
        assert self.num_warps in (1, 2, 4, 8, 16), f"num_warps must be 1..16, a power of 2: {self}"
        assert 1 <= self.up_stages <= 8 and 1 <= self.down_stages <= 8, f"stages must be 1..8: {self}"
        assert 1 <= self.ctas_per_sm <= 32, f"ctas_per_sm must be 1..32: {self}"


BLOCK_TUNED: dict[tuple[int, int, int, int], MoeBlockConfig] = {
    # (E, I, H, top_k) -> the best of `bench_moe_block --sweep` (bf16). Qwen3-30B-A3B on an H200, the top-k by sort
    # (docs/benchmarks/h200-moe-block-sorted-topk-2026-11-30c.jsonl): 27.03-27.08 us a layer, against 26.78 for the four
    # launches it replaces; with the argmax top-k 29.75 (the first sweep's best, 29.34, was the same tiles)
    (128, 768, 2048, 8): MoeBlockConfig(block_i=4, up_block_k=512, block_h=4, down_block_k=256, num_warps=4,
                                        up_stages=3, down_stages=2, ctas_per_sm=4),
}
BLOCK_CPU_CONFIG = MoeBlockConfig(8, 32, 8, 16, num_warps=1, up_stages=1, down_stages=1, ctas_per_sm=1)
"""The interpreter's: small tiles, few ops per step."""


def block_default_config(num_experts: int, inter: int, hidden: int, top_k: int,
                         device: torch.device) -> MoeBlockConfig:
    """The tuned configuration of this shape, else the small path's tuned Qwen3-30B-A3B tiles (gate/up 8 x 256,
    down 4 x 128, 4 warps, 3 stages) with 2 programs per SM."""
    if device.type == "cpu":
        return BLOCK_CPU_CONFIG
    return BLOCK_TUNED.get((num_experts, inter, hidden, top_k), MoeBlockConfig())
