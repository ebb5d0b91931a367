"""Where an offline run's time goes: `radixmesh bench offline --profile`.

Every launched batch is timed on the device with a pair of CUDA events (recorded around the
launch, read once at the end: no sync on the way), so the run splits into extend (prefill) and
decode device time, device idle time (host-bound gaps), and decode time against batch size and
context length (the KV bytes each step must read). A few windows of steps are also traced with
torch.profiler and their kernels grouped by kind (attention, GEMM, norms and other fused layers,
sampling, copies). On a CPU the event timing is skipped and only the batch mix is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

KERNEL_KINDS = (
    ("decode-attention", ("decode_", "_fwd_kernel_stage", "split_kv")),
    ("extend-attention", ("extend", "prefill", "flash", "fmha")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")),
    ("norm-rope-act", ("rmsnorm", "rms_norm", "rotary", "rope", "silu", "act_and_mul")),
    ("sampling", ("argmax", "softmax", "sample", "topk", "sort", "logsumexp")),
    ("copy-index", ("copy", "memcpy", "memset", "index", "gather", "scatter", "fill", "staging", "cat")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


@dataclass
class _Launch:
    is_decode: bool
    num_tokens: int
    batch_size: int
    context_tokens: int
    start: Any
    end: Any


@dataclass
class OfflineProfiler:
    """Wraps `Scheduler.launch`; `window_steps` are launch indices where a traced window of
    `window_len` launches starts."""

    sched: Any
    window_steps: tuple[int, ...] = (200, 1500, 4000)
    window_len: int = 12
    launches: list[_Launch] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    _trace: Any = None
    _trace_start: int = 0
    _wall_start: float = 0.0

    def __post_init__(self) -> None:
        import torch

        self._cuda = self.sched.runner.device.type == "cuda"
        self._torch = torch
        inner = self.sched.launch

        def timed_launch(batch: Any) -> Any:
            self._maybe_trace(len(self.launches))
            start = end = None
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            launched = inner(batch)
            if end is not None:
                end.record()
            self.launches.append(_Launch(batch.is_decode, len(batch.input_ids), len(batch.reqs),
                                         sum(batch.seq_lens), start, end))
            return launched

        self.sched.launch = timed_launch

    def begin(self) -> None:
        self._wall_start = time.perf_counter()

    def _maybe_trace(self, index: int) -> None:
        if self._trace is not None and index - self._trace_start >= self.window_len:
            self._close_trace(index)
        if self._trace is None and self._cuda and index in self.window_steps:
            prof = self._torch.profiler.profile(activities=[self._torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            self._trace, self._trace_start = prof, index

    def _close_trace(self, index: int) -> None:
        self._torch.cuda.synchronize()
        self._trace.__exit__(None, None, None)
        mix = self.launches[self._trace_start:index]
        self.windows.append({"first_launch": self._trace_start, "num_launches": len(mix),
                             "decode_launches": sum(x.is_decode for x in mix),
                             "mean_decode_batch": _mean([x.batch_size for x in mix if x.is_decode]),
                             "extend_tokens": sum(x.num_tokens for x in mix if not x.is_decode),
                             **_kinds(self._trace.key_averages(), self._torch)})
        self._trace = None

    def summary(self, kv_bytes_per_token: int) -> dict[str, Any]:
        """Call after the run's final sync."""
        if self._trace is not None:
            self._close_trace(len(self.launches))
        wall_s = time.perf_counter() - self._wall_start
        decode = [x for x in self.launches if x.is_decode]
        extend = [x for x in self.launches if not x.is_decode]
        out: dict[str, Any] = {
            "wall_s": round(wall_s, 3), "launches": len(self.launches), "decode_launches": len(decode),
            "extend_launches": len(extend), "extend_tokens": sum(x.num_tokens for x in extend),
            "mean_decode_batch": _mean([x.batch_size for x in decode]),
            "mean_decode_context": _mean([x.context_tokens / x.batch_size for x in decode]),
        }
        if self._cuda and self.launches:
            out.update(self._device_split(decode, extend, wall_s, kv_bytes_per_token))
        out["kernel_windows"] = self.windows
        return out

    def _device_split(self, decode: list[_Launch], extend: list[_Launch], wall_s: float,
                      kv_bytes_per_token: int) -> dict[str, Any]:
        decode_ms = [x.start.elapsed_time(x.end) for x in decode]
        extend_ms = [x.start.elapsed_time(x.end) for x in extend]
        busy_s = (sum(decode_ms) + sum(extend_ms)) / 1000
        kv_gb = sum(x.context_tokens for x in decode) * kv_bytes_per_token / 1e9
        buckets: dict[int, list[float]] = {}
        for x, ms in zip(decode, decode_ms):
            buckets.setdefault(min(256, 1 << max(0, x.batch_size - 1).bit_length()), []).append(ms)
        return {
            "decode_device_s": round(sum(decode_ms) / 1000, 3), "extend_device_s": round(sum(extend_ms) / 1000, 3),
            "device_idle_s": round(max(0.0, wall_s - busy_s), 3),
            "extend_tok_per_s": round(sum(x.num_tokens for x in extend) / max(sum(extend_ms) / 1000, 1e-9), 1),
            "decode_kv_read_gb": round(kv_gb, 2),
            "decode_kv_read_tb_per_s": round(kv_gb / 1000 / max(sum(decode_ms) / 1000, 1e-9), 3),
            "decode_ms_by_batch": {f"<={b}": {"steps": len(v), "mean_ms": round(sum(v) / len(v), 3)}
                                   for b, v in sorted(buckets.items())},
        }


def _kinds(events: Any, torch: Any) -> dict[str, Any]:
    totals: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = float(getattr(e, "self_device_time_total", 0.0))
        totals[kernel_kind(e.key)] = totals.get(kernel_kind(e.key), 0.0) + us
        top.append((us, e.key[:80]))
    top.sort(reverse=True)
    return {"kernel_ms_by_kind": {k: round(v / 1000, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[name, round(us / 1000, 3)] for us, name in top[:8]]}


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 2) if values else 0.0


def print_profile(profile: dict[str, Any]) -> None:
    skip = ("kernel_windows", "decode_ms_by_batch")
    for key, value in profile.items():
        if key not in skip:
            print(f"  profile {key:<24} {value}")
    for bucket, row in profile.get("decode_ms_by_batch", {}).items():
        print(f"  decode batch {bucket:<6} {row['steps']:>6} steps  {row['mean_ms']:>8.3f} ms")
    for window in profile["kernel_windows"]:
        print(f"  window @launch {window['first_launch']}: {window['decode_launches']}/{window['num_launches']} "
              f"decode, batch {window['mean_decode_batch']}, extend tokens {window['extend_tokens']}: "
              f"{window['kernel_ms_by_kind']}")
