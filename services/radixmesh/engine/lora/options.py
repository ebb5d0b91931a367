"""Checks of the LoRA options of `EngineConfig` (called from its `__post_init__`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.common.errors import invalid_argument
from radixmesh.wire.lora import TARGET_MODULES, parse_lora_path

if TYPE_CHECKING:
    from radixmesh.engine.config import EngineConfig

MAX_LORA_RANK = 256
"""The kernels' largest slot rank (`radixmesh.kernels.lora.MAX_RANK`)."""
MAX_LORA_SLOTS = 128
LORA_KERNELS = ("auto", "grouped", "fused", "rows", "epilogue")
"""The decode kernel sets (`radixmesh.kernels.lora.KERNELS`; the engine imports no kernels on CPU)."""
LORA_OVERLAP = ("auto", "on", "side", "off")
"""--lora-overlap: auto (CUDA decode passes of more than one row with the per-row kernels, the expand on the side
stream too) | on (every CUDA pass whose adapters run as a separate shrink and expand; the expand after the join) |
side (as on, the expand on the side stream too, added after the join) | off (`radixmesh.engine.lora.overlap`)."""


def check_lora_options(config: EngineConfig) -> None:
    """INVALID_ARGUMENT for LoRA options out of bounds or combined with what they do not run with."""
    object.__setattr__(config, "lora_paths", tuple(config.lora_paths))
    object.__setattr__(config, "lora_target_modules", tuple(config.lora_target_modules))
    if not 1 <= config.max_lora_rank <= MAX_LORA_RANK:
        raise invalid_argument(f"max_lora_rank must be in [1, {MAX_LORA_RANK}]", "max_lora_rank")
    if not 1 <= config.max_loras_per_batch <= MAX_LORA_SLOTS:
        raise invalid_argument(f"max_loras_per_batch must be in [1, {MAX_LORA_SLOTS}]", "max_loras_per_batch")
    if config.max_loaded_loras < 1:
        raise invalid_argument("max_loaded_loras must be >= 1", "max_loaded_loras")
    if config.lora_kernels not in LORA_KERNELS:
        raise invalid_argument(f"lora_kernels must be one of {', '.join(LORA_KERNELS)}", "lora_kernels")
    if config.lora_overlap not in LORA_OVERLAP:
        raise invalid_argument(f"lora_overlap must be one of {', '.join(LORA_OVERLAP)}", "lora_overlap")
    unknown = [m for m in config.lora_target_modules if m not in TARGET_MODULES]
    if unknown:
        raise invalid_argument(f"lora_target_modules: {', '.join(unknown)} not among {', '.join(TARGET_MODULES)}",
                               "lora_target_modules")
    names = [parse_lora_path(item)[0] for item in config.lora_paths]
    if len(set(names)) != len(names):
        raise invalid_argument(f"--lora-paths names an adapter twice: {names}", "lora_paths")
    if len(names) > config.max_loaded_loras:
        raise invalid_argument(f"--lora-paths gives {len(names)} adapters; --max-loaded-loras is "
                               f"{config.max_loaded_loras}", "lora_paths")
    if config.lora_enabled and config.speculative_algorithm is not None:
        raise invalid_argument("LoRA adapters do not run with speculative decoding yet", "speculative_algorithm")
    if config.lora_enabled and config.enable_hierarchical_cache:
        raise invalid_argument("LoRA adapters do not run with the hierarchical cache yet", "enable_lora")


def target_modules(config: EngineConfig) -> tuple[str, ...]:
    """The projections with adapter slots."""
    return config.lora_target_modules or TARGET_MODULES
