"""Pieces shared by the MoE and LoRA benchmarks: the device's copy bandwidth, graph timing, the run's
identity, and a short text table of a result file."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

import torch
import triton

from radixmesh.kernels.bench_gemv import time_per_call_ms


def copy_bandwidth_tb_s(num_bytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy of `num_bytes`: (bytes read + bytes written) / time, in TB/s (the floor of a
    memory-bound kernel is its bytes over this)."""
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * num_bytes * reps / (start.elapsed_time(end) / 1000) / 1e12


def time_us(calls: Sequence[Callable[[], object]]) -> float | None:
    """Microseconds per call of `calls` replayed in one CUDA graph, or None (reported) when a call fails
    (a tile over the shared-memory limit, a path this GPU lacks)."""
    try:
        return round(time_per_call_ms(list(calls)) * 1000, 2)
    except Exception as exc:
        print(f"# skipped: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def trace_medians(launch: Callable[[torch.Tensor], object], points: Sequence[str], rounds: int) -> dict[str, float]:
    """Medians over `rounds` launches of a persistent kernel whose programs stamp their global timer at `points`
    (`moe_block.TRACE_POINTS`-style: row per program, ns in columns 0.., the first the entry): per launch the
    microseconds from the first program's entry to the last program done with each point (`<point>_last_us`) and to
    the first program past each barrier (`barrier*_first_us`), and the programs that ran. `launch(stamps)` runs
    one launch with the stamps tensor (PDL is the caller's business)."""
    stamps = torch.zeros(torch.cuda.get_device_properties(0).multi_processor_count * 32, 16, dtype=torch.int64,
                         device="cuda")
    per_launch: dict[str, list[float]] = {}
    for _ in range(rounds):
        stamps.zero_()
        launch(stamps)
        ns = stamps[:, :len(points)]
        ns = ns[ns[:, 0] > 0].double()  # the grid's rows
        start = ns[:, 0].min()
        for i, point in enumerate(points[1:], 1):
            per_launch.setdefault(f"{point}_last_us", []).append(float(ns[:, i].max() - start) / 1e3)
            if point.startswith("barrier"):
                per_launch.setdefault(f"{point}_first_us", []).append(float(ns[:, i].min() - start) / 1e3)
        per_launch.setdefault("programs", []).append(float(ns.shape[0]))
    return {k: round(float(torch.tensor(v).median()), 2) for k, v in per_launch.items()}


def run_info(module: str) -> dict[str, object]:
    """Device, versions and command line of this run (every result line carries them)."""
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python", "-m", module, *sys.argv[1:]])}


def print_table(paths: Sequence[str], bench: str, columns: Sequence[tuple[str, str]]) -> None:
    """The lines of `bench` in the JSON-lines `paths` as a fixed-width table (`columns`: header, key)."""
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [r for line in f if line.startswith("{") and (r := json.loads(line)).get("bench") == bench]
    if not rows:  # (a run without that part, e.g. no sweep)
        return
    widths = [max(len(head), *(len(_cell(r.get(key))) for r in rows)) for head, key in columns]
    print("  ".join(head.rjust(w) for (head, _), w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_cell(r.get(key)).rjust(w) for (_, key), w in zip(columns, widths)))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
