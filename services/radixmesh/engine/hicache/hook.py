"""The host tier in the scheduler: each step starts loads of waiting requests' host-cached prefixes, and
admission leaves out requests whose prefix is still loading (controller.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixmesh.engine.hicache.controller import HiCacheController
from radixmesh.engine.hicache.tree import HiRadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler.hooks import SchedulerHook

if TYPE_CHECKING:
    from radixmesh.engine.scheduler.core import Scheduler


class HostTierHook(SchedulerHook):
    """Runs the host tier's controller at the start of each step and gates admission on its loads."""

    def __init__(self, sched: Scheduler, controller: HiCacheController) -> None:
        self.sched = sched
        self.controller = controller

    def on_step_start(self) -> None:
        sched = self.sched
        self.controller.tick(sched.prefill.waiting, sched.running, sched.decode.new_token_ratio)

    def admissible(self, waiting: list[Req]) -> list[Req]:
        return self.controller.ready(waiting)

    @property
    def busy(self) -> bool:
        return self.controller.busy

    def idle_wait(self, timeout_s: float) -> bool:
        if not self.controller.loading:
            return False
        self.controller.wait(timeout_s)  # only loads are pending: wait for one here
        return True

    def stats(self) -> dict[str, float | int]:
        return self.controller.stats()


def create_hook(sched: Scheduler) -> HostTierHook | None:
    """With --enable-hierarchical-cache (the scheduler's radix tree is then a HiRadixCache); else None."""
    tree = sched.kv.tree
    if not isinstance(tree, HiRadixCache):
        return None
    return HostTierHook(sched, HiCacheController(sched.kv, tree, sched.config.schedule_policy_window))
