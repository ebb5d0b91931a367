"""The fault benchmark's accounting of streams through a fault, on made-up records."""

from __future__ import annotations

from radixmesh.cluster.faults.integrity import affected, migration_cost, token_counts
from radixmesh.cluster.faults.load import RequestRecord, _take_frame


def record(sent: float, frames: list[float], num_tokens: int, usage: int | None = None,
           outcome: str = "completed") -> RequestRecord:
    r = RequestRecord("chat-stream", sent, first_frame_s=frames[0] if frames else None,
                      end_s=frames[-1] if frames else None, outcome=outcome, frame_s=frames, num_tokens=num_tokens,
                      completion_tokens=num_tokens if usage is None else usage)
    return r


def test_tokens_lost_and_duplicated_against_the_expected_count() -> None:
    records = [record(0, [1, 2], 4), record(0, [1, 2], 3), record(0, [1, 2], 6, usage=4),
               record(0, [1], 1, outcome="failed")]
    assert token_counts(records, 4) == {"checked_streams": 3, "tokens_lost": 1, "tokens_duplicated": 2,
                                        "usage_mismatches": 1}


def test_the_stall_of_streams_through_the_fault_against_the_usual_gap() -> None:
    steady = [record(0, [1.0, 1.1, 1.2, 1.3], 4), record(5, [6.0, 6.1, 6.2], 3)]
    moved = record(2, [2.5, 2.6, 4.6, 4.7], 4)  # streaming at 3.0: a 2 s pause
    late = record(3.5, [4.9, 5.0], 2)  # sent after the fault: its first token came 1.4 s later
    cost = migration_cost([*steady, moved, late], [3.0])
    assert affected([*steady, moved, late], [3.0]) == [moved]
    assert cost["affected_streams"] == 1 and cost["stall_max_ms"] == 2000.0 and cost["itl_p50_ms"] == 100.0
    assert cost["ttft_p50_ms_before"] == 750.0  # 1.0 and 0.5 s
    assert cost["ttft_p50_ms_after_fault"] == 1200.0  # the late one (1.4 s) and the one sent at 5 s (1.0 s)


def test_frames_count_log_prob_entries_and_text_and_usage() -> None:
    r = RequestRecord("chat-stream", 0.0)
    _take_frame(r, {"choices": [{"delta": {"role": "assistant"}}]}, 0.1)
    _take_frame(r, {"choices": [{"delta": {"content": "Hel"}, "logprobs": {"content": [{}, {}]}}]}, 0.2)
    _take_frame(r, {"choices": [{"delta": {"content": "lo"}, "logprobs": {"content": [{}]}}]}, 0.3)
    _take_frame(r, {"choices": [], "usage": {"completion_tokens": 3}}, 0.4)
    assert (r.text, r.num_tokens, r.completion_tokens, r.frame_s, r.first_frame_s) == ("Hello", 3, 3, [0.2, 0.3], 0.2)
