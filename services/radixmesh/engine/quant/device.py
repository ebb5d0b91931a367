"""Where FP8 can run, and the KV pool's storage dtype.

FP8 arithmetic (tensor-core FP8 GEMMs, FP8 conversions in the Triton kernels) needs an NVIDIA GPU of
compute capability 8.9 or newer (Ada, Hopper, Blackwell). On older GPUs `--quantization fp8` and
`--kv-cache-dtype fp8_*` are refused with that requirement named. On the CPU both run the reference
path: FP8 storage, dequantized to float32 per use (slow; it exists for tests and small models).
"""

from __future__ import annotations

import logging

import torch

from radixmesh.common.errors import unsupported

MIN_FP8_CAPABILITY = (8, 9)
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""`--kv-cache-dtype` values besides auto, and the pool dtype each stores."""

logger = logging.getLogger(__name__)


def require_fp8(device: torch.device, what: str, param: str) -> None:
    """Raise UNSUPPORTED naming the requirement when `device` cannot run FP8 (`what` is the feature asked for)."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise unsupported(f"{what} runs on CUDA GPUs (compute capability >= 8.9) or on the CPU, not on {device}",
                          param)
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise unsupported(f"{what} needs a GPU with FP8 support (compute capability >= 8.9: Ada, Hopper or newer); "
                          f"{name} has {major}.{minor}", param)


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device,
                     attention_backend: str) -> torch.dtype:
    """The KV pool's storage dtype for `--kv-cache-dtype` (auto: the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    require_fp8(device, f"--kv-cache-dtype {kv_cache_dtype}", "kv_cache_dtype")
    if attention_backend == "flashinfer":
        raise unsupported(f"--kv-cache-dtype {kv_cache_dtype} is read by the triton and torch-native attention "
                          f"backends; flashinfer is not wired for FP8 KV", "kv_cache_dtype")
    if device.type == "cpu":
        logger.info("KV pool in %s on the CPU: stored in FP8, read back in %s (reference path)", dtype, model_dtype)
    return dtype
