"""How many programs of a compiled Triton kernel the GPU holds at once: the size of a persistent grid whose
programs wait on each other (a grid barrier deadlocks if any of them cannot be resident)."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch


class SmLimits(NamedTuple):
    """What one SM holds."""

    regs: int = 65536
    threads: int = 2048
    smem_bytes: int = 233472  # 228 KiB, of which each resident program reserves 1 KiB
    ctas: int = 32


HOPPER_SM = SmLimits()


def fitting_ctas(n_regs: int, shared_bytes: int, num_warps: int, sm: SmLimits = HOPPER_SM) -> int:
    """Programs of a kernel that one SM holds at once (registers in 256 per warp, 1 KiB reserved per program)."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    return min(sm.ctas, sm.threads // (32 * num_warps), sm.regs // (warp_regs * num_warps),
               sm.smem_bytes // (shared_bytes + 1024))


def driver_fit(function: int, threads: int, shared_bytes: int) -> int | None:
    """The driver's own count of resident programs (`cuOccupancyMaxActiveBlocksPerMultiprocessor`), or None."""
    try:
        count = ctypes.c_int(0)
        rc = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(count), ctypes.c_void_p(function), ctypes.c_int(threads), ctypes.c_size_t(shared_bytes))
    except (OSError, AttributeError, TypeError):
        return None
    return count.value if rc == 0 and count.value > 0 else None


def resident_programs(compiled: Any, device: torch.device, ctas_per_sm: int) -> int:
    """SMs x `ctas_per_sm`, lowered to what an SM holds of `compiled` (a Triton `CompiledKernel`: its registers,
    shared memory and warps, and the driver's count where it answers); asserts that one program fits."""
    compiled._init_handles()  # (loads the binary: its register count and function handle)
    props = torch.cuda.get_device_properties(device)
    sm = SmLimits(getattr(props, "regs_per_multiprocessor", HOPPER_SM.regs),
                  getattr(props, "max_threads_per_multi_processor", HOPPER_SM.threads),
                  getattr(props, "shared_memory_per_multiprocessor", HOPPER_SM.smem_bytes))
    num_warps, shared = compiled.metadata.num_warps, compiled.metadata.shared
    fit = fitting_ctas(compiled.n_regs, shared, num_warps, sm)
    fit = min(fit, driver_fit(compiled.function, 32 * num_warps, shared) or fit)
    assert fit >= 1, f"a program ({compiled.n_regs} registers x {num_warps} warps, {shared} B shared) fits no SM: {sm}"
    return int(props.multi_processor_count * min(ctas_per_sm, fit))
