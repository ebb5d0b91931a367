"""Decode side: receives still landing in a reservation's slots (a transport's `PendingReceive`, e.g. a NIXL READ).

The reservation manager polls them once per scheduler iteration instead of blocking on them. Each one is
also held to the exporting side's lease: the prefill worker keeps the rows from its export (which comes after
this side granted the reservation) for `lease_s` at most, so a receive not done by `granted_at + lease_s`
(less a safety margin) may read rows that were reused there: it is stopped, or its KV rejected.

A reservation given up while a receive still runs (its lease lapsed, the request was cancelled, the prefill
worker timed out) first tries to cancel it; one that cannot be cancelled keeps its slots out of the free list
here ("draining") until it ends, so nothing lands in slots another request was given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.disagg.transport.base import PendingReceive

logger = logging.getLogger(__name__)

LEASE_SAFETY = 0.02
"""Fraction of the exporting side's lease not relied on (the two clocks' rates, and its tick's timing)."""
LEASE_MARGIN_S = 0.05


@dataclass
class InFlight:
    """One receive of a reservation and whether it landed."""

    pending: PendingReceive
    done: bool = False


def lease_deadline(granted_at: float, lease_s: float) -> float:
    return granted_at + lease_s * (1 - LEASE_SAFETY) - LEASE_MARGIN_S


def poll_receives(receives: list[InFlight], granted_at: float, now: float) -> str | None:
    """Advance a reservation's receives; the error that sinks the transfer, or None (done or still running)."""
    for item in receives:
        if item.done:
            continue
        lease_s = item.pending.lease_s
        try:
            item.done = item.pending.poll()
        except RadixMeshError as exc:
            return exc.message
        if lease_s is not None and now > lease_deadline(granted_at, lease_s):
            if not item.done:
                item.pending.cancel()  # if it cannot be stopped, freeing the reservation drains it
            return (f"the KV arrived after the exporting worker's lease of {lease_s:g} s ran out (it may have reused "
                    "those rows)")
    return None


class Draining:
    """Slots of given-up reservations whose receives could not be cancelled: freed once those ended."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None]) -> None:
        self.free_slots = free_slots
        self._entries: list[tuple[list[InFlight], torch.Tensor]] = []

    @property
    def num_slots(self) -> int:
        return sum(int(slots.shape[0]) for _, slots in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def give_up(self, receives: list[InFlight], slots: torch.Tensor) -> None:
        """Stop the receives into `slots` and free them, now or once the last running one ended."""
        running = [item for item in receives if not item.done and not item.pending.cancel()]
        if not running:
            self.free_slots(slots)
            return
        logger.warning("%d KV receive(s) could not be cancelled; their %d slots are freed once they end",
                       len(running), int(slots.shape[0]))
        self._entries.append((running, slots))

    def tick(self) -> None:
        for entry in list(self._entries):
            receives, slots = entry
            if all(_ended(item) for item in receives):
                self._entries.remove(entry)
                self.free_slots(slots)


def _ended(item: InFlight) -> bool:
    try:
        item.done = item.done or item.pending.poll()
    except RadixMeshError:
        return True
    return item.done
