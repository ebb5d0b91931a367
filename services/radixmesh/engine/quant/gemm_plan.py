"""Which kernel runs each W8A8 FP8 GEMM: `torch._scaled_mm` (cuBLASLt/CUTLASS, row-wise scales) or the
Triton kernel `radixmesh.kernels.fp8_gemm`, chosen per weight shape (N, K) and bucket of M by timing
both on this GPU when the model loads (`--fp8-gemm-backend auto`), or fixed by the flag.

`torch._scaled_mm` with row-wise scales needs compute capability >= 9.0, a bf16 output and N, K
multiples of 16; elsewhere (Ada GPUs, fp16/fp32 models, odd shapes) the Triton kernel runs. A
candidate that fails to run here is dropped with a warning, so an unsupported path never reaches
serving. Choosing is host work on ints only, so calls stay capturable in CUDA graphs.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable, Iterable

import torch

from radixmesh.common.errors import unsupported

M_BUCKETS = (2, 8, 32, 128, 512, 2048, 8192)
"""Upper bounds of the M ranges chosen for separately (decode batches up to prefill chunks)."""
SCALED_MM, TRITON = "scaled-mm", "triton"
_REPS = 5

logger = logging.getLogger(__name__)


def scaled_mm_fits(n: int, k: int, out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales takes this GEMM on `device`."""
    if device.type != "cuda" or out_dtype != torch.bfloat16 or n % 16 or k % 16 or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`[M, N]`: `xq` `[M, K]` FP8 with per-row `xs` `[M]`, `w` `[N, K]` FP8 with per-row `ws` `[N]`."""
    # mat2 must be column-major: W.T of a row-major [N, K] weight is
    out: torch.Tensor = torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                         out_dtype=out_dtype)
    return out


def triton_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    from radixmesh.kernels.fp8_gemm import fp8_gemm

    return fp8_gemm(xq, xs, w, ws, out_dtype)


GEMMS: dict[str, Callable[..., torch.Tensor]] = {SCALED_MM: scaled_mm, TRITON: triton_gemm}


class Fp8GemmPlan:
    """The kernel of every (N, K, M) FP8 GEMM of one model, and the timings it was chosen by."""

    def __init__(self, backend: str, device: torch.device, out_dtype: torch.dtype) -> None:
        assert backend in ("auto", SCALED_MM, TRITON), f"unknown FP8 GEMM backend {backend!r}"
        self.backend, self.device, self.out_dtype = backend, device, out_dtype
        self.table: dict[tuple[int, int], list[str]] = {}
        """(N, K) -> kernel per M bucket."""
        self.timings: list[dict[str, object]] = []

    def plan(self, shapes: Iterable[tuple[int, int]]) -> None:
        """Choose the kernels of these weight shapes (measuring them under `auto`)."""
        for n, k in sorted(set(shapes)):
            fits = scaled_mm_fits(n, k, self.out_dtype, self.device)
            if self.backend == SCALED_MM and not fits:
                logger.warning("torch._scaled_mm cannot run the %dx%d FP8 GEMM here (needs compute capability "
                               ">= 9.0, bf16 output, N and K multiples of 16): the Triton kernel runs it", n, k)
            if self.backend == "auto" and fits:
                self.table[(n, k)] = [self._measure(n, k, m) for m in M_BUCKETS]
            else:
                self.table[(n, k)] = [SCALED_MM if self.backend == SCALED_MM and fits else TRITON] * len(M_BUCKETS)
        logger.info("FP8 GEMM kernels per (N, K) for M up to %s: %s", M_BUCKETS, self.table)

    def choice(self, n: int, k: int, m: int) -> str:
        row = self.table.get((n, k))
        if row is None:
            return SCALED_MM if self.backend != TRITON and scaled_mm_fits(n, k, self.out_dtype, self.device) else TRITON
        return row[min(bisect.bisect_left(M_BUCKETS, m), len(M_BUCKETS) - 1)]

    def __call__(self, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        return GEMMS[self.choice(n, k, xq.shape[0])](xq, xs, w, ws, self.out_dtype)

    def _measure(self, n: int, k: int, m: int) -> str:
        """The faster kernel for one shape; one that fails here is dropped (both failing raises)."""
        from radixmesh.kernels.fp8_ref import quantize_rows

        gen = torch.Generator(device=self.device).manual_seed(n + k + m)
        xq, xs = quantize_rows(torch.randn(m, k, device=self.device, generator=gen))
        w, ws = quantize_rows(torch.randn(n, k, device=self.device, generator=gen) * 0.02)
        row: dict[str, object] = {"n": n, "k": k, "m": m}
        for name, fn in GEMMS.items():
            try:
                call = functools.partial(fn, xq, xs, w, ws, self.out_dtype)
                row[f"{name}_us"] = round(time_gemm(call) * 1e6, 2)
            except Exception as exc:  # an unsupported kernel must not reach serving
                logger.warning("FP8 GEMM %s failed on %dx%dx%d and is not used: %s", name, m, n, k, exc)
        times = {name: row[f"{name}_us"] for name in GEMMS if f"{name}_us" in row}
        if not times:
            raise unsupported(f"no FP8 GEMM kernel runs on this device for shape {m}x{n}x{k}", "quantization")
        row["choice"] = min(times, key=lambda name: float(times[name]))  # type: ignore[arg-type]
        self.timings.append(row)
        return str(row["choice"])


def time_gemm(call: Callable[[], object], reps: int = _REPS) -> float:
    """Seconds per call on the device (after one warm-up call, which also compiles)."""
    call()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps
