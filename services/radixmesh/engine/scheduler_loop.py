"""The scheduler process's loop: drain the local channel, step the scheduler, send what it produced."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from radixmesh.engine.disagg.messages import DISAGG_MSG_TYPES
from radixmesh.engine.messages import (
    AbortReqMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ServerInfoReqMsg,
    ShutdownReqMsg,
    encoder,
    to_scheduler_decoder,
)
from radixmesh.engine.mm.runtime import ReqImages
from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.disagg.handler import DisaggHandler
    from radixmesh.engine.kv_events import BlockEventRecorder

IDLE_POLL_MS = 50


class SchedulerLoop:
    def __init__(self, scheduler: Any, send: zmq.Socket, kv_events: BlockEventRecorder | None = None) -> None:
        self.scheduler = scheduler
        self.send = send
        self.kv_events = kv_events
        self.disagg: DisaggHandler | None = None
        """Prefill/decode disaggregation: reservations, KV exports and their leases."""
        self.stopping = False

    def info(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.scheduler.stats()
        if self.disagg is not None:
            stats.update(self.disagg.stats())
        images = getattr(self.scheduler.runner, "mm", None)
        if images is not None:
            stats["num_images_encoded"] = images.num_images_encoded
        return stats

    def run(self, recv: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(recv, zmq.POLLIN)
        parent_pid = os.getppid()
        while not self.stopping:
            self._drain(recv)
            if self.stopping:
                break
            deadline = self.scheduler.launch_deadline()
            if deadline is not None:
                self._listen_until(poller, recv, deadline)
            if self.disagg is not None:
                self.disagg.tick()  # right before the step: it queues KV exports ahead of the next launch
            stepped = self.scheduler.step()
            if self.kv_events is not None:
                self._send_kv_events()
            if not stepped:
                poller.poll(IDLE_POLL_MS)
                if os.getppid() != parent_pid:
                    logging.warning("the front end process is gone (killed?); stopping")
                    return

    def _listen_until(self, poller: zmq.Poller, recv: zmq.Socket, deadline: float) -> None:
        """Hold the next launch until a message arrives or `deadline` (whole milliseconds, rounded down: never
        late), then take what arrived."""
        wait_ms = int((deadline - time.perf_counter()) * 1000)
        if wait_ms > 0 and poller.poll(wait_ms):
            self._drain(recv)

    def _send_kv_events(self) -> None:
        assert self.kv_events is not None
        msg = self.kv_events.drain()
        if msg is not None:
            self.send.send(encoder.encode(msg))

    def _drain(self, recv: zmq.Socket) -> None:
        while True:
            try:
                raw = recv.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(to_scheduler_decoder.decode(raw.buffer))

    def _handle(self, msg: object) -> None:
        sched = self.scheduler
        if isinstance(msg, GenerateReqMsg):
            sched.add_request(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=msg.params,
                                  prefill_only=msg.prefill_only, mm=ReqImages(msg.mm) if msg.mm else None))
        elif isinstance(msg, AbortReqMsg):
            sched.abort(msg.rid)
            if self.disagg is not None:
                self.disagg.abort(msg.rid)
        elif isinstance(msg, FlushCacheReqMsg):
            flushed = sched.flush_cache()
            images = getattr(sched.runner, "mm", None)
            if flushed and images is not None:
                images.cache.clear()  # vision features too: a flushed server encodes every image again
            self._reply(msg.query_id, {"success": flushed})
        elif isinstance(msg, ServerInfoReqMsg):
            self._reply(msg.query_id, self.info())
        elif isinstance(msg, ShutdownReqMsg):
            self.stopping = True
        elif isinstance(msg, DISAGG_MSG_TYPES) and self.disagg is not None:
            self.disagg.handle(msg)

    def _reply(self, query_id: str, result: dict[str, Any]) -> None:
        self.send.send(encoder.encode(QueryOutMsg(query_id, result)))
