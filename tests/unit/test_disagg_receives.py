"""Decode-side receives still landing in a reservation's slots: polling them against the exporting side's lease,
and slots of given-up reservations held back ("draining") until receives that could not be cancelled ended."""

from __future__ import annotations

import pytest
import torch

from radixmesh.common.errors import ErrorCode, RadixMeshError
from radixmesh.engine.disagg.receives import (
    LEASE_MARGIN_S,
    LEASE_SAFETY,
    Draining,
    InFlight,
    lease_deadline,
    poll_receives,
)
from radixmesh.engine.disagg.transport.base import PendingReceive


class Scripted(PendingReceive):
    """A receive whose polls answer from a script (True/False, or an exception), and that may refuse cancel."""

    def __init__(self, polls: list[bool | Exception], lease_s: float | None = None, cancellable: bool = True) -> None:
        self.polls, self.lease_s, self.cancellable = list(polls), lease_s, cancellable
        self.num_polls = self.num_cancels = 0

    def poll(self) -> bool:
        self.num_polls += 1
        answer = self.polls.pop(0) if len(self.polls) > 1 else self.polls[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def cancel(self) -> bool:
        self.num_cancels += 1
        return self.cancellable


def test_lease_deadline_keeps_a_safety_share_and_margin() -> None:
    assert lease_deadline(100.0, 10.0) == pytest.approx(100.0 + 10.0 * (1 - LEASE_SAFETY) - LEASE_MARGIN_S)
    assert lease_deadline(0.0, 10.0) < 10.0


def test_running_receives_are_polled_until_done_then_left_alone() -> None:
    first, second = Scripted([False, True]), Scripted([True])
    receives = [InFlight(first), InFlight(second)]
    assert poll_receives(receives, granted_at=0.0, now=1.0) is None
    assert [r.done for r in receives] == [False, True]
    assert poll_receives(receives, granted_at=0.0, now=2.0) is None
    assert [r.done for r in receives] == [True, True]
    assert poll_receives(receives, granted_at=0.0, now=3.0) is None
    assert (first.num_polls, second.num_polls) == (2, 1)


def test_a_failed_receive_sinks_the_transfer_with_its_message() -> None:
    receives = [InFlight(Scripted([RadixMeshError(ErrorCode.UNAVAILABLE, "the NIXL READ failed")]))]
    assert poll_receives(receives, 0.0, 0.1) == "the NIXL READ failed"


def test_a_receive_past_the_lease_is_cancelled_and_rejected() -> None:
    late = Scripted([False], lease_s=5.0)
    receives = [InFlight(late)]
    assert poll_receives(receives, granted_at=10.0, now=14.0) is None and late.num_cancels == 0
    error = poll_receives(receives, granted_at=10.0, now=15.0)
    assert error is not None and "lease of 5 s" in error and late.num_cancels == 1


def test_kv_that_landed_after_the_lease_is_rejected_without_cancel() -> None:
    landed = Scripted([True], lease_s=1.0)
    receives = [InFlight(landed)]
    assert poll_receives(receives, granted_at=0.0, now=2.0) is not None
    assert receives[0].done and landed.num_cancels == 0


def test_a_receive_without_a_lease_never_runs_out() -> None:
    receives = [InFlight(Scripted([False]))]
    assert poll_receives(receives, granted_at=0.0, now=1e9) is None


# ---- Draining ------------------------------------------------------------------------------------------------
def slots(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def test_given_up_receives_that_cancel_free_their_slots_at_once() -> None:
    freed: list[list[int]] = []
    draining = Draining(lambda s: freed.append(s.tolist()))
    running, done = Scripted([False]), Scripted([True])
    draining.give_up([InFlight(running), InFlight(done, done=True)], slots(1, 2))
    assert freed == [[1, 2]] and len(draining) == 0 and running.num_cancels == 1
    assert done.num_cancels == 0  # a receive that landed needs no cancel


def test_slots_of_an_uncancellable_receive_wait_until_it_ends() -> None:
    freed: list[list[int]] = []
    draining = Draining(lambda s: freed.append(s.tolist()))
    stuck = Scripted([False, True], cancellable=False)
    draining.give_up([InFlight(stuck)], slots(4, 5, 6))
    assert freed == [] and len(draining) == 1 and draining.num_slots == 3
    draining.tick()
    assert freed == [] and draining.num_slots == 3
    draining.tick()
    assert freed == [[4, 5, 6]] and len(draining) == 0 and draining.num_slots == 0
    draining.tick()
    assert freed == [[4, 5, 6]]  # freed once


def test_a_receive_that_fails_while_draining_counts_as_ended() -> None:
    freed: list[list[int]] = []
    draining = Draining(lambda s: freed.append(s.tolist()))
    draining.give_up([InFlight(Scripted([RadixMeshError(ErrorCode.UNAVAILABLE, "peer gone")], cancellable=False))],
                     slots(7))
    draining.tick()
    assert freed == [[7]]


def test_each_reservation_drains_on_its_own() -> None:
    freed: list[list[int]] = []
    draining = Draining(lambda s: freed.append(s.tolist()))
    slow = Scripted([False], cancellable=False)
    quick = Scripted([False, True], cancellable=False)
    draining.give_up([InFlight(slow)], slots(1))
    draining.give_up([InFlight(quick), InFlight(Scripted([True]), done=True)], slots(2, 3))
    assert len(draining) == 2 and draining.num_slots == 3
    draining.tick()
    draining.tick()
    assert freed == [[2, 3]] and len(draining) == 1 and draining.num_slots == 1
