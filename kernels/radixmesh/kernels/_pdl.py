"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a batch-1 decode step.

A batch-1 step on an 8B model is ~230 short launches; each one's first loads wait for the kernel
before it to end, and its last programs run while most SMs idle. With PDL a kernel is launched
while the one before it still runs: its programs start, load what does not depend on the earlier
kernel (a GEMV's first weight tile), and block in `gdc_wait` until the earlier kernel has ended and
its writes are visible. The earlier kernel lets the next one start with `gdc_launch_dependents`.

The rule every kernel launched this way keeps: nothing it reads that an earlier kernel writes, and
nothing it writes, comes before its `gdc_wait`, which every program runs. Then a kernel ends only
after the one before it ended, so ordering stays transitive down the stream. Kernels launched
without PDL (PyTorch's, cuBLAS) keep the stream's ordinary ordering on both sides.

One pair bends the rule on purpose: a LoRA shrink (`radixmesh.kernels.lora_gemv`) lets the next kernel start
right after its own `gdc_wait`, when every kernel before it has ended, and the GEMV launched next with the
shrink's epilogue reads x (written before the shrink) at once and waits only before its epilogue, which reads
what the shrink wrote. The GEMV still ends after the shrink, so the ordering down the stream holds.

The switch is process-wide (`set_pdl`); the model runner sets it from `--disable-pdl`. Off the GPU
(the Triton interpreter) and below compute capability 9.0 the kernels launch as before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton: kernels never take the PDL branch
    gdc_launch_dependents = gdc_wait = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "gdc_launch_dependents", "gdc_wait", "pdl_args", "pdl_enabled", "set_pdl"]

_state = {"enabled": True}


def set_pdl(enabled: bool) -> None:
    """Launch the decode kernels with PDL where the device supports it (the default), or never."""
    _state["enabled"] = bool(enabled)


@functools.lru_cache(maxsize=16)
def _supports(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    if not (AVAILABLE and _state["enabled"]) or device.type != "cuda":
        return False
    return _supports(device.index if device.index is not None else torch.cuda.current_device())


def pdl_args(device: torch.device, allowed: bool = True) -> dict[str, Any]:
    """Keyword arguments for a launch of a kernel with a `PDL: tl.constexpr` parameter (`allowed=False`: without
    PDL whatever the switch says, e.g. a launch right after a join of two streams)."""
    if allowed and pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
