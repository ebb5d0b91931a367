"""Summary statistics of a run: pure functions of its request results.

Percentiles interpolate linearly between order statistics (numpy's default, as SGLang's
bench_serving reports them). Throughputs divide by the run's duration; only successful
requests count. The cache hit rate is cached prompt tokens over prompt tokens, summed over
the successful requests whose responses reported a cached-token count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from loadtests.records import RequestResult

PERCENTILES = (50, 90, 99)
"""Percentiles reported besides the mean."""


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency, in milliseconds (NaN when there are no samples)."""

    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of_seconds(cls, values_s: Sequence[float]) -> LatencyStats:
        values_ms = [v * 1000.0 for v in values_s]
        return cls(mean_ms=mean(values_ms), median_ms=percentile(values_ms, 50), p90_ms=percentile(values_ms, 90),
                   p99_ms=percentile(values_ms, 99), count=len(values_ms))


@dataclass(frozen=True)
class LengthFit:
    """Least-squares line of a latency over prompt length: `intercept_ms + per_1k_ms * prompt_len / 1000`."""

    intercept_ms: float
    per_1k_ms: float
    """Added per 1,000 prompt tokens."""
    count: int

    @classmethod
    def of(cls, prompt_lens: Sequence[int], values_s: Sequence[float]) -> LengthFit | None:
        """The fit, or None with fewer than 3 points or a single prompt length."""
        if len(prompt_lens) < 3 or len(set(prompt_lens)) < 2:
            return None
        xs = [n / 1000 for n in prompt_lens]
        ys = [v * 1000 for v in values_s]
        x_mean, y_mean = mean(xs), mean(ys)
        slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / sum((x - x_mean) ** 2 for x in xs)
        return cls(intercept_ms=y_mean - slope * x_mean, per_1k_ms=slope, count=len(xs))


@dataclass(frozen=True)
class Summary:
    """The figures of one run."""

    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    """Completed requests per second."""
    input_throughput: float
    """Prompt tokens of completed requests per second."""
    output_throughput: float
    """Generated tokens per second."""
    total_throughput: float
    """Prompt plus generated tokens per second."""
    concurrency: float
    """Mean requests in flight: summed end-to-end latency over the duration."""
    cache_hit_rate: float | None
    """Cached prompt tokens over prompt tokens (None: no response reported cached tokens)."""
    ttft: LatencyStats
    itl: LatencyStats
    tpot: LatencyStats
    """Time per output token after the first, per request."""
    e2e: LatencyStats
    ttft_fit: LengthFit | None = None
    """TTFT over prompt length (uncached requests' prompt lengths as the server counts them)."""
    tokenize: LatencyStats | None = None
    """The server's own prompt tokenization time (Server-Timing), None when it reported none."""
    tokenize_share: float | None = None
    """Median over requests of tokenization time / TTFT (None when the server reported no tokenization)."""

    def to_dict(self) -> dict[str, Any]:
        return _nan_to_none(asdict(self))


def summarize(results: Sequence[RequestResult], duration_s: float) -> Summary:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return Summary(
        num_completed=len(ok), num_failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) * per_s, input_throughput=total_in * per_s,
        output_throughput=total_out * per_s, total_throughput=(total_in + total_out) * per_s,
        concurrency=sum(r.latency_s for r in ok) * per_s,
        cache_hit_rate=cache_hit_rate(ok),
        ttft=LatencyStats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=LatencyStats.of_seconds([gap for r in ok for gap in r.itl_s]),
        tpot=LatencyStats.of_seconds(tpots_s(ok)),
        e2e=LatencyStats.of_seconds([r.latency_s for r in ok]),
        ttft_fit=LengthFit.of(*_ttft_points(ok)),
        tokenize=_tokenize_stats(ok),
        tokenize_share=_tokenize_share(ok),
    )


def _ttft_points(results: Sequence[RequestResult]) -> tuple[list[int], list[float]]:
    """(prompt length, TTFT) of the requests with a first token; cached tokens are not computed, so they don't count."""
    points = [(r.prompt_len - (r.cached_len or 0), r.ttft_s) for r in results if r.ttft_s is not None]
    return [n for n, _ in points], [t for _, t in points]


def _tokenize_stats(results: Sequence[RequestResult]) -> LatencyStats | None:
    times = [r.tokenize_s for r in results if r.tokenize_s is not None]
    return LatencyStats.of_seconds(times) if times else None


def _tokenize_share(results: Sequence[RequestResult]) -> float | None:
    shares = [r.tokenize_s / r.ttft_s for r in results if r.tokenize_s is not None and r.ttft_s]
    return percentile(shares, 50) if shares else None


def cache_hit_rate(results: Sequence[RequestResult]) -> float | None:
    reported = [r for r in results if r.cached_len is not None]
    prompt_len = sum(r.prompt_len for r in reported)
    if not reported or prompt_len == 0:
        return None
    return sum(r.cached_len or 0 for r in reported) / prompt_len


def tpots_s(results: Sequence[RequestResult]) -> list[float]:
    """(latency - ttft) / (output_len - 1) of each request with a first token and more than one token."""
    return [(r.latency_s - r.ttft_s) / (r.output_len - 1)
            for r in results if r.ttft_s is not None and r.output_len > 1]


def throughput_timeline(results: Sequence[RequestResult], bin_s: float) -> list[tuple[float, float, float]]:
    """(bin start s, output tokens/s, completed requests/s) per bin of the run.

    A request's generated tokens are spread evenly over its chunks with text (a chunk may
    carry several tokens); a request counts as completed in the bin where it ends.
    """
    if bin_s <= 0:
        raise ValueError(f"bin width must be > 0, got {bin_s}")
    ok = [r for r in results if r.success]
    if not ok:
        return []
    num_bins = max(1, math.ceil(max(r.end_s for r in ok) / bin_s))
    tokens = [0.0] * num_bins
    completed = [0] * num_bins
    for r in ok:
        times = r.chunk_times_s()
        for t in times:
            tokens[min(int(t / bin_s), num_bins - 1)] += r.output_len / len(times)
        completed[min(int(r.end_s / bin_s), num_bins - 1)] += 1
    return [(i * bin_s, tokens[i] / bin_s, completed[i] / bin_s) for i in range(num_bins)]


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    return value
