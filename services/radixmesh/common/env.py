"""The one place radixmesh reads its environment: variables named RADIXMESH_<NAME>."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from radixmesh.common.errors import invalid_argument


def env_str(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"RADIXMESH_{name}", default)


def env_flag(name: str) -> bool:
    return (env_str(name) or "").lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """Where converted models and other caches live (RADIXMESH_CACHE_DIR, else ~/.cache/radixmesh)."""
    return Path(env_str("CACHE_DIR") or Path.home() / ".cache" / "radixmesh")


TOKENIZE_MIN_PIECE_CHARS_RANGE = (256, 1 << 20)
"""Bounds of RADIXMESH_TOKENIZE_MIN_PIECE_CHARS (a piece shorter than ~60 tokens costs more in hand-offs than it
saves; the upper bound keeps every prompt whole)."""


def tokenize_min_piece_chars() -> int | None:
    """RADIXMESH_TOKENIZE_MIN_PIECE_CHARS: the shortest piece a long prompt is cut into for the tokenizer pool's
    threads (`radixmesh.engine.split_encode`), checked (INVALID_ARGUMENT when not an integer in range); None: the
    default for the host's cores."""
    raw = (env_str("TOKENIZE_MIN_PIECE_CHARS") or "").strip()
    if not raw:
        return None
    low, high = TOKENIZE_MIN_PIECE_CHARS_RANGE
    value = int(raw) if raw.lstrip("-").isdigit() else None
    if value is None or not low <= value <= high:
        raise invalid_argument(f"RADIXMESH_TOKENIZE_MIN_PIECE_CHARS must be an integer in [{low}, {high}] "
                               f"(got {raw!r})", "RADIXMESH_TOKENIZE_MIN_PIECE_CHARS")
    return value


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """RADIXMESH_<name>, lower-cased, one of `choices` (INVALID_ARGUMENT otherwise); unset: the first."""
    value = (env_str(name) or choices[0]).strip().lower()
    if value not in choices:
        raise invalid_argument(f"RADIXMESH_{name} must be one of {', '.join(choices)} (got {value!r})",
                               f"RADIXMESH_{name}")
    return value


MOE_PATHS = ("auto", "small", "sorted", "block")
"""Values of RADIXMESH_MOE_PATH (radixmesh.kernels.moe.MOE_PATHS, and `block`: a one-token pass runs its whole MoE
block, norm and router included, in one persistent kernel, `radixmesh.kernels.moe_block`)."""


def moe_path() -> str:
    """RADIXMESH_MOE_PATH: how the MoE layers run on CUDA, checked (INVALID_ARGUMENT when not one of `MOE_PATHS`):
    `auto` (the small-batch path up to its token threshold), `small` or `sorted` always (A/B runs), `block` (auto, and
    the whole-block kernel at one token)."""
    return _choice("MOE_PATH", MOE_PATHS)


ATTN_BLOCK_MODES = ("off", "on")
"""Values of RADIXMESH_ATTN_BLOCK: `on`, a one-token decode pass runs each layer's attention half (input norm, q/k/v,
rotary, KV store, attention, o) in one persistent kernel (`radixmesh.kernels.attn_block`); `off`, the default,
runs today's launches (on an H200 the block was slower: docs/moe.md)."""


def attn_block_mode() -> str:
    """RADIXMESH_ATTN_BLOCK, checked (INVALID_ARGUMENT when not one of `ATTN_BLOCK_MODES`)."""
    return _choice("ATTN_BLOCK", ATTN_BLOCK_MODES)


DECODE_FP8_WIDENS = ("f32", "direct", "f16")
"""Values of RADIXMESH_DECODE_FP8_WIDEN (radixmesh.kernels.decode_attention.FP8_WIDENS)."""


@dataclass(frozen=True)
class DecodeFp8Tuning:
    """How decode attention reads an FP8 KV pool (bf16 pools keep the kernel's own tiles)."""

    tiles: tuple[int, int, int] | None = None
    """(BLOCK_N, num_warps, num_stages) of the split kernel (RADIXMESH_DECODE_FP8_TILES="128,4,3"); None: its
    defaults."""
    widen: str = "f32"
    """How e4m3 tiles become dot operands (RADIXMESH_DECODE_FP8_WIDEN: f32 | direct | f16)."""

    def __post_init__(self) -> None:
        if self.widen not in DECODE_FP8_WIDENS:
            raise invalid_argument(f"RADIXMESH_DECODE_FP8_WIDEN must be one of {', '.join(DECODE_FP8_WIDENS)} "
                                   f"(got {self.widen!r})", "RADIXMESH_DECODE_FP8_WIDEN")
        if self.tiles is None:
            return
        block_n, warps, stages = self.tiles
        if block_n < 16 or block_n > 256 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16) \
                or not 1 <= stages <= 8:
            raise invalid_argument("RADIXMESH_DECODE_FP8_TILES must be BLOCK_N,num_warps,num_stages with BLOCK_N a "
                                   f"power of 2 in [16, 256], warps in 1-16 (powers of 2), stages in 1-8 (got "
                                   f"{self.tiles})", "RADIXMESH_DECODE_FP8_TILES")

    @property
    def is_default(self) -> bool:
        return self.tiles is None and self.widen == "f32"


def decode_fp8_tuning() -> DecodeFp8Tuning:
    """RADIXMESH_DECODE_FP8_TILES and RADIXMESH_DECODE_FP8_WIDEN, checked (INVALID_ARGUMENT when malformed)."""
    raw_tiles = (env_str("DECODE_FP8_TILES") or "").strip()
    tiles = None
    if raw_tiles:
        try:
            block_n, warps, stages = (int(part) for part in raw_tiles.split(","))
        except ValueError:
            raise invalid_argument(f"RADIXMESH_DECODE_FP8_TILES must be three integers BLOCK_N,num_warps,num_stages "
                                   f"(got {raw_tiles!r})", "RADIXMESH_DECODE_FP8_TILES") from None
        tiles = (block_n, warps, stages)
    return DecodeFp8Tuning(tiles, (env_str("DECODE_FP8_WIDEN") or "f32").strip())


def gemv_tiles() -> str | None:
    """RADIXMESH_GEMV_TILES: batch-1 GEMV tiles that replace the tuned ones, for sweeps inside a model
    (`radixmesh.kernels.gemv.parse_tiles` reads it); None when unset or empty."""
    return (env_str("GEMV_TILES") or "").strip() or None


EVENT_LOOPS = ("auto", "uvloop", "asyncio")
"""Values of RADIXMESH_EVENT_LOOP (`radixmesh.common.aio.run_main`)."""
HTTP_PARSERS = ("auto", "httptools", "h11")
"""Values of RADIXMESH_HTTP_PARSER (uvicorn's `http` setting)."""


def event_loop() -> str:
    """RADIXMESH_EVENT_LOOP: the event loop the services run on, checked: `auto` (uvloop when installed), `uvloop`
    (an error without it) or `asyncio` (the standard library's)."""
    return _choice("EVENT_LOOP", EVENT_LOOPS)


def http_parser() -> str:
    """RADIXMESH_HTTP_PARSER: how the HTTP servers parse requests, checked: `auto` (httptools when installed),
    `httptools` or `h11` (pure Python)."""
    return _choice("HTTP_PARSER", HTTP_PARSERS)


STREAM_PRIORITIES = ("decode", "equal", "main")
"""Values of RADIXMESH_STREAM_PRIORITY (`radixmesh.engine.scheduler.decode_stream`)."""


def stream_priority() -> str:
    """RADIXMESH_STREAM_PRIORITY: with decode steps on a CUDA stream of their own, which stream has the device's
    greatest priority, checked: `decode` (the running step ends first; a prefill beside it takes what the step leaves),
    `equal` (both the least) or `main` (a prefill runs ahead of the step it was launched beside)."""
    return _choice("STREAM_PRIORITY", STREAM_PRIORITIES)
