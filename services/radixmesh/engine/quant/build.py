"""The linear method a model runs with, from `--quantization` and the checkpoint."""

from __future__ import annotations

import logging

import torch

from radixmesh.common.errors import unsupported
from radixmesh.engine.model_config import ModelConfig
from radixmesh.engine.quant.base import LinearMethod
from radixmesh.engine.quant.checkpoint import parse_quantization_config
from radixmesh.engine.quant.device import require_fp8
from radixmesh.engine.quant.registry import create_method

logger = logging.getLogger(__name__)


def build_linear_method(quantization: str | None, model_config: ModelConfig, device: torch.device,
                        dtype: torch.dtype, gemm_backend: str = "auto", fuse_quant: bool = True) -> LinearMethod | None:
    """The linear method of this model: `--quantization`, else the checkpoint's own; None when neither.

    An FP8 checkpoint runs in FP8 without the flag (as SGLang and vLLM do); asking for another method
    than the checkpoint's is refused.
    """
    checkpoint = parse_quantization_config(model_config.raw.get("quantization_config"))
    name = quantization or (checkpoint.method if checkpoint is not None else None)
    if name is None:
        return None
    if checkpoint is not None and name != checkpoint.method:
        raise unsupported(f"--quantization {name} cannot apply to a checkpoint already quantized "
                          f"({checkpoint.source_format}); leave the flag out or use {checkpoint.method}",
                          "quantization")
    what = f"--quantization {name}" if checkpoint is None else f"this {checkpoint.source_format} checkpoint"
    require_fp8(device, what, "quantization")
    if device.type == "cpu":
        logger.info("%s on the CPU: FP8 weights, float32 arithmetic (the reference path, not fast)", what)
    return create_method(name, device=device, dtype=dtype, checkpoint=checkpoint, gemm_backend=gemm_backend,
                         fuse_quant=fuse_quant)

