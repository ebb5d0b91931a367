"""Where an offline run's time goes: `radixmesh bench offline --profile`.

Every launched batch is timed on the device with a pair of CUDA events (recorded around the
launch, read once at the end: no sync on the way), so the run splits into extend (prefill) and
decode device time, device idle time (host-bound gaps), and decode time against batch size and
context length (the KV bytes each step must read). A few windows of steps are also traced with
torch.profiler and their kernels grouped by kind (attention, GEMM, norms and other fused layers,
sampling, copies), with the device's busy share and its waits between kernels. The device's wait before
each launch (from the previous launch's end event to this one's start event) is summed by the launch's kind, by
tenth of the run, and listed for the longest; waits right after a traced window opened or closed are the
profiler's own (its start and its closing sync) and counted apart: on an H100 they were 9.4 of the 9.8 s the
8B offline run's device waited (the rest: 0.4 s in 4,813 launches). On a CPU the event timing is skipped and only
the batch mix is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KERNEL_KINDS = (
    ("moe", ("moe", "_route_kernel", "_align_kernel", "_combine_kernel")),  # before gemm: "_moe_gemm_kernel"
    ("decode-attention", ("decode_", "_fwd_kernel_stage", "split_kv")),
    ("extend-attention", ("extend", "prefill", "flash", "fmha", "sdpa")),
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
    window_steps: tuple[int, ...] = (200, 800, 1500, 2500, 4000)
    window_len: int = 12
    launches: list[_Launch] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    profiler_edges: set[int] = field(default_factory=set)
    """Launches right after a traced window opened or closed: the device waited for the profiler there."""
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
            self.profiler_edges.add(index)
        if self._trace is None and self._cuda and index in self.window_steps:
            self.profiler_edges.add(index)
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
                             **_kinds(self._trace.key_averages(), self._torch),
                             **_gaps(self._trace.events(), self._torch)})
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
        # the device's wait between a launch's end and the next launch's start event (recorded when the host
        # began that launch, so this wait is host time not hidden behind the device; the launch's own host work
        # up to its first kernel counts in its device time above); waits right after a traced window opened or
        # closed are the profiler's, counted apart
        idle_before: dict[str, float] = {"decode": 0.0, "extend": 0.0, "profiler": 0.0}
        pairs = zip(self.launches, self.launches[1:])
        gaps = [0.0] + [max(0.0, prev.end.elapsed_time(cur.start)) for prev, cur in pairs]
        for index, (launch, gap) in enumerate(zip(self.launches, gaps)):
            kind = "profiler" if index in self.profiler_edges else "decode" if launch.is_decode else "extend"
            idle_before[kind] += gap
        gaps = [0.0 if i in self.profiler_edges else gap for i, gap in enumerate(gaps)]
        tenth = max(1, -(-len(gaps) // 10))
        long_gaps = [g for g in gaps if g > 1]
        longest = sorted(range(len(gaps)), key=gaps.__getitem__, reverse=True)[:6]
        return {
            "decode_device_s": round(sum(decode_ms) / 1000, 3), "extend_device_s": round(sum(extend_ms) / 1000, 3),
            "device_idle_s": round(max(0.0, wall_s - busy_s), 3),
            "idle_before_launch_s": {k: round(v / 1000, 3) for k, v in idle_before.items()},
            "idle_before_launch_by_tenth_s": [round(sum(gaps[i:i + tenth]) / 1000, 3)
                                              for i in range(0, len(gaps), tenth)],
            "idle_gaps_over_1ms": {"count": len(long_gaps), "total_s": round(sum(long_gaps) / 1000, 3)},
            "longest_idle_gaps": [{"launch": i, "ms": round(gaps[i], 2), "decode": self.launches[i].is_decode,
                                   "after_decode": self.launches[i - 1].is_decode if i else None,
                                   "batch": self.launches[i].batch_size} for i in longest],
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


GAP_US = 50.0
"""An interval between kernels longer than this counts as the device waiting for the host."""


def _gaps(events: Any, torch: Any) -> dict[str, Any]:
    """How busy the device was across a traced window: kernel time (overlaps merged) against the span from the
    first kernel's start to the last one's end, and the waits between kernels longer than GAP_US."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy = 0.0
    gaps: list[float] = []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end > GAP_US:
                gaps.append(start - cur_end)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(e for _, e in spans) - spans[0][0]
    return {"device_busy_ms": round(busy / 1000, 3), "device_span_ms": round(span / 1000, 3),
            "device_gaps": {"count": len(gaps), "total_ms": round(sum(gaps) / 1000, 3),
                            "max_ms": round(max(gaps, default=0.0) / 1000, 3)}}


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


def profile_prefill(sched: Any, make_req: Any, runs: int = 3) -> dict[str, Any]:
    """One request's prefill alone (`bench one-batch --profile-prefill`): wall time from submission to its
    first token, device time of its kernels by kind, and the rate of its GEMMs and attention.

    `make_req(i)` returns a fresh request (random prompt: nothing cached) asking for one token.
    """
    import torch

    from radixmesh.engine.models.layers import Linear

    walls: list[float] = []
    totals: list[float] = []
    kinds: dict[str, float] = {}
    top: dict[str, float] = {}
    phases = HostPhases(sched, PREFILL_PHASES)
    host_runs: list[dict[str, float]] = []
    num_tokens = 0
    for i in range(runs):
        req = make_req(i)
        num_tokens = len(req.origin_input_ids)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            sched.add_request(req)
            while sched.has_work:
                sched.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
            host_runs.append(phases.take())
        window = _kinds(prof.key_averages(), torch)
        totals.append(sum(window["kernel_ms_by_kind"].values()))
        for kind, ms in window["kernel_ms_by_kind"].items():
            kinds[kind] = kinds.get(kind, 0.0) + ms / runs
        for name, ms in window["top_kernels_ms"]:
            top[name] = top.get(name, 0.0) + ms / runs
    mc = sched.runner.model_config
    linear_params = sum(m.in_features * m.out_features for name, m in sched.runner.model.named_modules()
                        if isinstance(m, Linear) and not name.endswith("lm_head"))
    gemm_flops = 2 * linear_params * num_tokens
    # causal: each of QK^T and PV is N^2 / 2 multiply-adds per head dimension and query head
    attn_flops = 2 * num_tokens * num_tokens * mc.head_dim * mc.num_heads * mc.num_layers
    gemm_ms, attn_ms = kinds.get("gemm", 0.0), kinds.get("extend-attention", 0.0)
    phases.detach()
    return {"prefill_tokens": num_tokens, "prefill_runs": runs, "prefill_host_ms": _prefill_host_ms(host_runs),
            "prefill_wall_ms": round(1000 * statistics.median(walls), 3),
            "prefill_device_ms": round(statistics.median(totals), 3),
            "prefill_ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "prefill_gemm_tflops": round(gemm_flops / max(gemm_ms, 1e-9) / 1e9, 1),
            "prefill_attention_tflops": round(attn_flops / max(attn_ms, 1e-9) / 1e9, 1),
            "prefill_top_kernels_ms": [[n, round(ms, 3)] for n, ms in sorted(top.items(), key=lambda kv: -kv[1])[:8]]}


class HostPhases:
    """Total host time in chosen methods of a scheduler (owner "sched") and of its parts (an attribute of it, e.g.
    "runner", or an object given in `owners`), nested ones counted in each; `take` returns the totals so far and
    starts again, `detach` removes the timers."""

    def __init__(self, sched: Any, phases: Mapping[str, tuple[str, ...]],
                 owners: Mapping[str, Any] | None = None) -> None:
        self.totals: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str]] = []
        for owner, names in phases.items():
            target = sched if owner == "sched" else (owners or {}).get(owner) or getattr(sched, owner)
            for name in names:
                self._wrap(target, name)

    def _wrap(self, target: Any, name: str) -> None:
        inner = getattr(target, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

        setattr(target, name, timed)
        self._wrapped.append((target, name))

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals

    def detach(self) -> None:
        for target, name in self._wrapped:
            vars(target).pop(name, None)  # the class's own method shows through again
        self._wrapped.clear()


PREFILL_PHASES = {"sched": ("schedule", "launch"), "results": ("process", "_wait_for_results")}
"""What `--profile-prefill` times on the host: scheduling, the eager forward's launches, reading results (and,
within it, the wait for the device)."""


def _prefill_host_ms(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median over runs, in ms: schedule, launch, results less the wait, the wait for the device."""
    def split(run: dict[str, float]) -> dict[str, float]:
        wait = run.get("_wait_for_results", 0.0)
        return {"schedule": run.get("schedule", 0.0), "launch": run.get("launch", 0.0),
                "results": run.get("process", 0.0) - wait, "wait_for_device": wait}

    rows = [split(run) for run in runs]
    return {k: round(1000 * statistics.median(r[k] for r in rows), 3) for k in rows[0]} if rows else {}
