"""A per-step timeline of the scheduler, for finding where a request's time to first token goes.

With `RADIXMESH_STEP_TRACE=PATH` set in the scheduler's environment, every batch writes one JSON line to PATH
(`{pid}` in it becomes the process id): its kind, rows and new tokens, and host times (`time.perf_counter()`,
seconds) of the step's start, the end of scheduling, the launch returning and the results reaching the host; on
CUDA also when the device started and finished its work, from events recorded around the launch, on the host's
clock (aligned once at start). Requests write a line when they reach the scheduler (`arrive`) and when their first
token's batch is read back (`first`). Off unless set: no events, no writes. Summarise with
`scripts/step_trace_summary.py`.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import IO, TYPE_CHECKING, Any

from radixmesh.engine.scheduler.hooks import SchedulerHook

if TYPE_CHECKING:
    from radixmesh.engine.batch import ScheduleBatch
    from radixmesh.engine.request import Req
    from radixmesh.engine.sampling.sampler import SampleOutput
    from radixmesh.engine.scheduler.core import Scheduler

ENV = "RADIXMESH_STEP_TRACE"


def create_hook(sched: Scheduler) -> StepTraceHook | None:
    """The hook when `RADIXMESH_STEP_TRACE` names a file, else None."""
    path = os.environ.get(ENV, "")
    if not path:
        return None
    device = getattr(sched.runner, "device", None)
    return StepTraceHook(open(path.replace("{pid}", str(os.getpid())), "a", buffering=1),
                         getattr(device, "type", "cpu") == "cuda")


class DeviceClock:
    """CUDA events placed on the host's clock: one reference event, synchronized once, is time zero."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda
        self.ref = self.cuda.Event(enable_timing=True)
        self.ref.record()
        self.ref.synchronize()
        self.ref_host = time.perf_counter()

    def event(self) -> Any:
        ev = self.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def host_time(self, ev: Any) -> float:
        """The host-clock time of a completed event (within the event timer's resolution and the alignment's)."""
        return self.ref_host + self.ref.elapsed_time(ev) / 1000


class StepTraceHook(SchedulerHook):
    def __init__(self, out: IO[str], cuda: bool) -> None:
        self.out = out
        self.clock = DeviceClock() if cuda else None
        self.step_start = 0.0
        self.launches: dict[int, dict[str, Any]] = {}  # id(batch) -> the record being filled
        self.pending: deque[tuple[dict[str, Any], Any, Any]] = deque()  # records waiting for their device times

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def take_request(self, req: Req) -> bool:
        self._write({"ev": "arrive", "rid": req.rid, "t": time.perf_counter(), "prompt": len(req.origin_input_ids)})
        return False

    def on_step_start(self) -> None:
        self.step_start = time.perf_counter()
        self._drain_device_times()

    def launch(self, batch: ScheduleBatch, launch_id: int) -> SampleOutput | None:
        record = {"ev": "batch", "id": launch_id, "kind": "decode" if batch.is_decode else "extend",
                  "rows": len(batch.reqs), "tokens": sum(batch.extend_lens), "t_step": self.step_start,
                  "t_sched": time.perf_counter()}
        if not batch.is_decode:
            record["rids"] = [r.rid for r in batch.reqs]
            record["first"] = [r.rid for r in batch.reqs if not r.is_chunked and not r.output_ids]
        if self.clock is not None:
            record["_start"] = self.clock.event()
        self.launches[id(batch)] = record
        return None

    def on_launched(self, batch: ScheduleBatch) -> None:
        record = self.launches.get(id(batch))
        if record is None:
            return
        record["t_launched"] = time.perf_counter()
        if self.clock is not None:
            self.pending.append((record, record.pop("_start"), self.clock.event()))

    def on_results(self, batch: ScheduleBatch) -> None:
        record = self.launches.pop(id(batch), None)
        if record is None:
            return
        record["t_results"] = time.perf_counter()
        if self.clock is None:
            self._write(record)
        else:
            record["_done"] = True
            self._drain_device_times()

    def _drain_device_times(self) -> None:
        """Write the records whose results were read and whose events completed, in launch order (the file is
        line-buffered: each record is on disk once written)."""
        clock = self.clock
        while clock is not None and self.pending:
            record, start, end = self.pending[0]
            if not record.get("_done") or not end.query():
                return
            self.pending.popleft()
            del record["_done"]
            record["t_dev_start"], record["t_dev_end"] = clock.host_time(start), clock.host_time(end)
            self._write(record)
