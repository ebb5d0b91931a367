"""What a fault cost the streams that lived through it: tokens lost or duplicated, answers that changed, and
the pause a migration put into a stream (time to first token and inter-token latency around the fault).

Every request of the load is greedy with exactly `max_tokens` tokens, each streamed with its log-prob, so
the client counts what it got: fewer is a loss, more a duplicate. The requests that were streaming when a
fault hit (the ones that had to move) are sent again once the cluster is healthy, and their texts compared:
a migrated stream must read exactly as an undisturbed one.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from radixmesh.cluster.faults.load import LoadGen, RequestRecord, RequestSpec

MAX_REFERENCE_REQUESTS = 24
"""Most requests sent again to compare their texts (the affected ones first)."""
SHORT_REFERENCE_REQUESTS = 8
"""The same with `bench faults --short`: its 4 clients put at most 8 streams through a rolling restart's two steps,
so every affected stream is still compared; the others, one at a time at ~2 s each on a 2-core CPU, went."""


def token_counts(records: Sequence[RequestRecord], expected_tokens: int) -> dict[str, int]:
    """Over completed streams: tokens lost and duplicated (against `expected_tokens` each), and streams whose
    usage disagrees with what the client got."""
    done = [r for r in records if r.outcome == "completed" and r.kind == "chat-stream"]
    return {"checked_streams": len(done),
            "tokens_lost": sum(max(0, expected_tokens - r.num_tokens) for r in done),
            "tokens_duplicated": sum(max(0, r.num_tokens - expected_tokens) for r in done),
            "usage_mismatches": sum(1 for r in done if r.completion_tokens != r.num_tokens)}


def affected(records: Sequence[RequestRecord], fault_times: Sequence[float]) -> list[RequestRecord]:
    """Requests that had started streaming and not ended when one of the faults began."""
    return [r for r in records if r.first_frame_s is not None and any(
        r.first_frame_s <= t and (r.end_s is None or r.end_s > t) for t in fault_times)]


def migration_cost(records: Sequence[RequestRecord], fault_times: Sequence[float],
                   window_s: float = 10.0) -> dict[str, Any]:
    """The pause in the affected streams (their longest gap between frames) against the usual gap between frames,
    and the time to first token of requests sent within `window_s` after a fault against those sent before."""
    hit = {id(r) for r in affected(records, fault_times)}
    done = [r for r in records if r.outcome == "completed" and len(r.frame_s) > 1]
    usual = [b - a for r in done if id(r) not in hit for a, b in zip(r.frame_s, r.frame_s[1:])]
    stalls = [max(b - a for a, b in zip(r.frame_s, r.frame_s[1:])) for r in done if id(r) in hit]
    first = min(fault_times) if fault_times else None
    ttfts = [(r.sent_s, t) for r in records if (t := _ttft(r)) is not None]
    ttft_before = [t for sent, t in ttfts if first is not None and sent < first]
    ttft_after = [t for sent, t in ttfts if any(f <= sent < f + window_s for f in fault_times)]
    return {"affected_streams": len(hit), "itl_p50_ms": _ms(_median(usual)), "stall_p50_ms": _ms(_median(stalls)),
            "stall_max_ms": _ms(max(stalls) if stalls else None),
            "ttft_p50_ms_before": _ms(_median(ttft_before)), "ttft_p50_ms_after_fault": _ms(_median(ttft_after)),
            "ttft_max_ms_after_fault": _ms(max(ttft_after) if ttft_after else None)}


async def text_mismatches(base_url: str, make_spec: Callable[[int], RequestSpec], records: Sequence[RequestRecord],
                          fault_times: Sequence[float], timeout_s: float,
                          max_requests: int = MAX_REFERENCE_REQUESTS) -> dict[str, int]:
    """Send the affected completed requests again (one at a time, the cluster healthy; then others, `max_requests`
    in all) and count the answers whose text differs from the streamed one."""
    hit = [r for r in affected(records, fault_times) if r.outcome == "completed" and r.kind == "chat-stream"]
    hit_ids = {id(r) for r in hit}
    others = [r for r in records if r.outcome == "completed" and r.kind == "chat-stream" and id(r) not in hit_ids]
    chosen = (hit + others)[:max_requests]
    if not chosen:
        return {"compared": 0, "compared_affected": 0, "text_mismatches": 0}
    indices = [r.index for r in chosen]
    again = LoadGen(base_url, lambda i: make_spec(indices[i]), 1, len(indices), timeout_s)
    compared = [(r, ref) for r, ref in zip(chosen, await again.run()) if ref.outcome == "completed"]
    return {"compared": len(compared), "compared_affected": sum(1 for r, _ in compared if id(r) in hit_ids),
            "text_mismatches": sum(1 for r, ref in compared if r.text != ref.text)}


def _ttft(record: RequestRecord) -> float | None:
    return None if record.first_frame_s is None else record.first_frame_s - record.sent_s


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
