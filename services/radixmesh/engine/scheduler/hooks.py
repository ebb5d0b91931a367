"""The scheduler's plug-in points: optional features (grammar, host tier, speculation, launch pacing) are hooks.

A hook overrides the methods of `SchedulerHook` it needs; every other method keeps its no-op default. The
scheduler calls them through one `HookSet`, in the order of `SCHEDULER_HOOKS`, at fixed points of a step:

    intake      take_request, remove
    step        on_step_start, needs_host_tokens, idle_wait, busy
    schedule    admissible (prefill), decode_batch (decode)
    launch      launch_scope, launch, vocab_mask, on_launched, launch_deadline
    results     on_results, token_verdict, settle, after_tokens
    other       flush, stats

`HookSet` calls only the hooks that override a method, so a feature that is off costs nothing per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from radixmesh.common.registry import LazyRegistry

if TYPE_CHECKING:
    from radixmesh.engine.batch import LaunchedBatch, ScheduleBatch
    from radixmesh.engine.grammar.vocab_mask import VocabMask
    from radixmesh.engine.request import FinishReason, Req
    from radixmesh.engine.sampling.sampler import HostSample, SampleOutput
    from radixmesh.engine.scheduler.core import Scheduler

Verdict = tuple["FinishReason | None", "int | None"]
"""(finish reason, matched stop token) a hook gives for a sampled token."""
H = TypeVar("H", bound="SchedulerHook")


class SchedulerHook:
    """An optional feature of the scheduler. Each method says when the scheduler calls it; defaults do nothing."""

    # ---- intake -----------------------------------------------------------------------------------
    def take_request(self, req: Req) -> bool:
        """A new, valid request: True when the hook holds it (it hands it to `Scheduler.enqueue` later)."""
        return False

    def remove(self, rid: str) -> list[Req]:
        """An abort: the requests of `rid` the hook holds, now dropped (the scheduler finishes them)."""
        return []

    # ---- the step ---------------------------------------------------------------------------------
    def on_step_start(self) -> None:
        """First thing of every step, before the previous batch's tokens are read and the next is scheduled."""

    def needs_host_tokens(self, in_flight: LaunchedBatch) -> bool:
        """Whether the batch on the device must be processed before the next one is scheduled."""
        return False

    def idle_wait(self, timeout_s: float) -> bool:
        """Nothing was launched or processed this step: wait (up to `timeout_s`) for the hook's own work and
        return True, or return False when it has none."""
        return False

    @property
    def busy(self) -> bool:
        """The hook holds work the scheduler must keep stepping for (requests, loads)."""
        return False

    # ---- scheduling -------------------------------------------------------------------------------
    def admissible(self, waiting: list[Req]) -> list[Req]:
        """The waiting requests prefill admission may take this step (the hook may leave some out)."""
        return waiting

    def decode_batch(self, reqs: list[Req]) -> ScheduleBatch | None:
        """Build this step's decode batch of `reqs` itself (None: the plain decode batch)."""
        return None

    # ---- launch -----------------------------------------------------------------------------------
    def launch_scope(self, batch: ScheduleBatch) -> AbstractContextManager[None] | None:
        """A context the batch's launch runs in (a CUDA stream), from its `launch` to its `on_launched`; None: none."""
        return None

    def launch(self, batch: ScheduleBatch, launch_id: int) -> SampleOutput | None:
        """Launch a batch of the hook's own kind (None: the model runner launches it)."""
        return None

    def vocab_mask(self, batch: ScheduleBatch, launch_id: int) -> VocabMask | None:
        """While the batch's forward pass is queued, before sampling: masks of rows the hook constrains."""
        return None

    def on_launched(self, batch: ScheduleBatch) -> None:
        """The model runner's launch of `batch` returned (its work is queued on the device)."""

    def launch_deadline(self) -> float | None:
        """Until when (`time.perf_counter()`) the loop may hold the next launch; None: no hold."""
        return None

    # ---- results ----------------------------------------------------------------------------------
    def on_results(self, batch: ScheduleBatch) -> None:
        """A launched batch's results reached the host, before its tokens are appended."""

    def token_verdict(self, req: Req, token_id: int) -> Verdict | None:
        """A sampled token appended to a request the stop rules let run on: finish it (a verdict) or not (None)."""
        return None

    def settle(self, req: Req, host: HostSample, row: int) -> None:
        """The request's tokens of this batch (`row`) were appended: settle the launch's own bookkeeping."""

    def after_tokens(self, req: Req) -> None:
        """After `settle`, before a finished request is released: a running request may change course."""

    # ---- other ------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """The cache is flushed with no request left: drop the hook's caches; False refuses the flush."""
        return True

    def stats(self) -> dict[str, Any]:
        """Counters for /server_info."""
        return {}


HookFactory = Callable[["Scheduler"], "SchedulerHook | None"]
SCHEDULER_HOOKS: LazyRegistry[HookFactory] = LazyRegistry("scheduler hook", {
    "step-trace": "radixmesh.engine.scheduler.step_trace:create_hook",
    "launch-pacing": "radixmesh.engine.scheduler.pacing:create_hook",
    "decode-stream": "radixmesh.engine.scheduler.decode_stream:create_hook",
    "grammar": "radixmesh.engine.grammar.hook:create_hook",
    "host-tier": "radixmesh.engine.hicache.hook:create_hook",
    "speculative": "radixmesh.engine.speculative.decoder:create_hook",
    "lora": "radixmesh.engine.lora.hook:create_hook",
})
"""Hook id -> factory taking the scheduler, returning the hook (None where the feature is off). The order is
the order of calls (the step trace, on with RADIXMESH_STEP_TRACE, sees a step before the others; launch pacing
times the step from its very start; a grammar's requests join the queue before the host tier looks at it;
speculation settles a request's KV before a grammar jumps it forward)."""

_METHODS = tuple(name for name, value in vars(SchedulerHook).items()
                 if callable(value) and not name.startswith("_"))


class HookSet:
    """The scheduler's hooks, called in order; for each method only the hooks that override it."""

    def __init__(self, hooks: list[SchedulerHook] | None = None) -> None:
        self.hooks: list[SchedulerHook] = []
        self._by_method: dict[str, list[SchedulerHook]] = {name: [] for name in _METHODS}
        self._busy: list[SchedulerHook] = []
        for hook in hooks or []:
            self.add(hook)

    @classmethod
    def build(cls, sched: Scheduler) -> HookSet:
        """Every registered hook whose feature is on for this scheduler."""
        hooks = cls()
        for hook_id in SCHEDULER_HOOKS.ids:
            hook = SCHEDULER_HOOKS.load(hook_id)(sched)
            if hook is not None:
                hooks.add(hook)
        return hooks

    def add(self, hook: SchedulerHook, first: bool = False) -> None:
        """Add `hook`, called after the hooks already added (before them with `first`)."""
        self.hooks.insert(0 if first else len(self.hooks), hook)
        for name in _METHODS:
            if getattr(type(hook), name) is not getattr(SchedulerHook, name):
                self._by_method[name].insert(0 if first else len(self._by_method[name]), hook)
        if type(hook).busy is not SchedulerHook.busy:
            self._busy.insert(0 if first else len(self._busy), hook)

    def get(self, kind: type[H]) -> H | None:
        """The hook of class `kind` (None when its feature is off)."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def __iter__(self) -> Iterator[SchedulerHook]:
        return iter(self.hooks)

    def overriding(self, method: str) -> list[SchedulerHook]:
        """The hooks that override `method`, in order (callers on the hot path iterate over these)."""
        return self._by_method[method]

    # ---- combined calls ---------------------------------------------------------------------------
    def take_request(self, req: Req) -> bool:
        return any(h.take_request(req) for h in self._by_method["take_request"])

    def remove(self, rid: str) -> list[Req]:
        return [req for h in self._by_method["remove"] for req in h.remove(rid)]

    def on_step_start(self) -> None:
        for h in self._by_method["on_step_start"]:
            h.on_step_start()

    def needs_host_tokens(self, in_flight: LaunchedBatch) -> bool:
        return any(h.needs_host_tokens(in_flight) for h in self._by_method["needs_host_tokens"])

    def idle_wait(self, timeout_s: float) -> bool:
        return any(h.idle_wait(timeout_s) for h in self._by_method["idle_wait"])

    @property
    def busy(self) -> bool:
        return any(h.busy for h in self._busy)

    def admissible(self, waiting: list[Req]) -> list[Req]:
        for h in self._by_method["admissible"]:
            waiting = h.admissible(waiting)
        return waiting

    def decode_batch(self, reqs: list[Req]) -> ScheduleBatch | None:
        return _first(h.decode_batch(reqs) for h in self._by_method["decode_batch"])

    def launch_scope(self, batch: ScheduleBatch) -> AbstractContextManager[None]:
        scope = _first(h.launch_scope(batch) for h in self._by_method["launch_scope"])
        return scope if scope is not None else _NO_SCOPE

    def launch(self, batch: ScheduleBatch, launch_id: int) -> SampleOutput | None:
        return _first(h.launch(batch, launch_id) for h in self._by_method["launch"])

    def vocab_mask(self, batch: ScheduleBatch, launch_id: int) -> VocabMask | None:
        return _first(h.vocab_mask(batch, launch_id) for h in self._by_method["vocab_mask"])

    def on_launched(self, batch: ScheduleBatch) -> None:
        for h in self._by_method["on_launched"]:
            h.on_launched(batch)

    def launch_deadline(self) -> float | None:
        return _first(h.launch_deadline() for h in self._by_method["launch_deadline"])

    def on_results(self, batch: ScheduleBatch) -> None:
        for h in self._by_method["on_results"]:
            h.on_results(batch)

    def flush(self) -> bool:
        return all(h.flush() for h in self._by_method["flush"])

    def stats(self) -> dict[str, Any]:
        return {key: value for h in self._by_method["stats"] for key, value in h.stats().items()}


T = TypeVar("T")
_NO_SCOPE = contextlib.nullcontext()


def _first(values: Iterator[T | None]) -> T | None:
    return next((v for v in values if v is not None), None)
