"""Every row count a prefill's projections may see, run once per projection shape before a CUDA server is ready.

A GEMM library picks its kernel by the problem's shape, the row count included, and CUDA loads a kernel's module on
its first use; loading one while serving waits for the device to finish what it holds (measured on an H200,
`scripts/prefill_host_probe.py`: a new row count's projection call returned only after 2 s of queued device work).
A prefill that meets such a kernel stops overlapping its launches with the device's work: the eager forward's ~10
ms of launches add to its time to first token, and the decode step queued before it waits too. The prefill
warm-up's few prompt lengths leave most row counts' kernels unloaded; this ladder runs each distinct projection
(shape, dtype, quantization: one layer stands for all of its kind) at every row count from 2 to 256, every 4th to
1,024 and every 8th to the longest prefill pass (the LM head to 256 rows), which loads what the library picks in
between as well (H200, the four 8B projections to 4,096 rows: 2.1 s; afterwards a call with a new row count no
longer waited).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from radixmesh.engine.models.layers import Linear

logger = logging.getLogger(__name__)

def gemm_rows(top: int) -> list[int]:
    """The row counts to run, 2 .. `top` (one row runs the GEMV kernel, captured in decode graphs): every one to
    256, where kernels change often, every 4th to 1,024, every 8th above, and `top`."""
    rows: list[int] = []
    n = 2
    while n <= top:
        rows.append(n)
        n += 1 if n < 256 else 4 if n < 1024 else 8
    if rows and rows[-1] != top:
        rows.append(top)
    return rows


def distinct_projections(model: nn.Module) -> list[Linear]:
    """One `Linear` per kind: input and output width, weight dtype, quantization method, bias."""
    kinds: dict[tuple[Any, ...], Linear] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            key = (module.in_features, module.out_features, module.weight.dtype,
                   type(module.quant_method).__name__, module.bias is not None)
            kinds.setdefault(key, module)
    return list(kinds.values())


HEAD_ROWS = 256
"""The LM head sees one row per request of a pass (never a prompt's tokens): its ladder stops here (a [4096, vocab]
output would be a gigabyte that serving never allocates)."""


@torch.inference_mode()
def warm_up_gemms(model: nn.Module, top: int, dtype: torch.dtype, device: torch.device) -> tuple[int, float]:
    """Run every distinct projection at every row count of the ladder up to `top` rows (the LM head to `HEAD_ROWS`);
    (calls, seconds)."""
    start = time.perf_counter()
    layers = distinct_projections(model)
    widest = max((layer.in_features for layer in layers), default=0)
    rows = gemm_rows(top)
    if not layers or not rows:
        return 0, 0.0
    head = getattr(model, "lm_head", None)
    x = torch.randn(rows[-1], widest, device=device, dtype=dtype) * 0.01
    calls = 0
    for n in rows:
        for layer in layers:
            if layer is head and n > HEAD_ROWS:
                continue
            Linear._project(layer, x[:n, :layer.in_features])  # (no prologue, adapter or all-reduce)
            calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d projection kinds at %d row counts up to %d, in %.2f s", len(layers), len(rows), top,
                seconds)
    return calls, seconds
