"""PNG charts of a run (or of several, overlaid): latency CDFs and throughput over time.

matplotlib is imported only when a chart is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests.metrics import throughput_timeline
from loadtests.report import RunReport

DPI = 110


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(runs: Sequence[RunReport], stem: Path) -> list[Path]:
    """Write `<stem>-latency-cdf.png` and `<stem>-throughput.png`; returns their paths."""
    plt = _pyplot()
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [_latency_cdfs(plt, runs, Path(f"{stem}-latency-cdf.png")),
             _throughput(plt, runs, Path(f"{stem}-throughput.png"))]
    return paths


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted values, fraction of values <= each)."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def _latency_cdfs(plt: Any, runs: Sequence[RunReport], path: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("Time to first token", lambda rs: [r.ttft_s * 1000 for r in rs if r.ttft_s is not None]),
        ("Inter-token latency", lambda rs: [g * 1000 for r in rs for g in r.itl_s]),
        ("End-to-end latency", lambda rs: [r.latency_s * 1000 for r in rs]),
    ]
    for ax, (title, values_of) in zip(axes, panels):
        for run in runs:
            values = values_of([r for r in run.record.results if r.success])
            if values:
                xs, ys = cdf_points(values)
                ax.step([xs[0], *xs], [0.0, *ys], where="post", label=run.label)
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _throughput(plt: Any, runs: Sequence[RunReport], path: Path) -> Path:
    fig, (tok_ax, req_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for run in runs:
        bin_s = max(run.record.duration_s / 50, 0.1)
        timeline = throughput_timeline(run.record.results, bin_s)
        if not timeline:
            continue
        # each bin's value holds until the bin's end: repeat the last one at the end of the run
        edges = [t for t, _, _ in timeline] + [timeline[-1][0] + bin_s]
        tok_ax.step(edges, [tok for _, tok, _ in timeline] + [timeline[-1][1]], where="post", label=run.label)
        req_ax.step(edges, [req for _, _, req in timeline] + [timeline[-1][2]], where="post", label=run.label)
    tok_ax.set_ylabel("output tokens/s")
    req_ax.set_ylabel("completed requests/s")
    req_ax.set_xlabel("seconds from start")
    for ax in (tok_ax, req_ax):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
