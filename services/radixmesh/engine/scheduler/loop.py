"""The scheduler process's loop: drain the local channel, step the scheduler, send what it produced.

Messages are routed by type to handlers (`route`): the loop's own (generate, abort, flush, server info,
shutdown) and those a feature registers (disaggregation's). Features that act within a step are scheduler
hooks, not branches here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from radixmesh.engine.mm.runtime import ReqImages
from radixmesh.engine.request import Req
from radixmesh.wire.messages import (
    AbortReqMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ServerInfoReqMsg,
    ShutdownReqMsg,
    encoder,
    to_scheduler_decoder,
)

if TYPE_CHECKING:
    from radixmesh.engine.kv_events import BlockEventRecorder
    from radixmesh.engine.scheduler.core import Scheduler

IDLE_POLL_MS = 50


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, send: zmq.Socket, kv_events: BlockEventRecorder | None = None) -> None:
        self.scheduler = scheduler
        self.send = send
        self.kv_events = kv_events
        self.stopping = False
        self.handlers: dict[type, Callable[[Any], None]] = {
            GenerateReqMsg: self._generate, AbortReqMsg: self._abort, FlushCacheReqMsg: self._flush,
            ServerInfoReqMsg: lambda msg: self.reply(msg.query_id, self.info()),
            ShutdownReqMsg: self._shutdown,
        }

    def route(self, msg_types: tuple[type, ...], handler: Callable[[Any], None]) -> None:
        """Send messages of `msg_types` to `handler` (a feature's own messages)."""
        for msg_type in msg_types:
            self.handlers[msg_type] = handler

    def info(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.scheduler.stats()
        images = self.scheduler.runner.mm
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
            self.handle(to_scheduler_decoder.decode(raw.buffer))

    def handle(self, msg: object) -> None:
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(msg)

    def _generate(self, msg: GenerateReqMsg) -> None:
        self.scheduler.add_request(Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=msg.params,
                                       prefill_only=msg.prefill_only, mm=ReqImages(msg.mm) if msg.mm else None,
                                       output_ids=list(msg.output_ids), lora_name=msg.lora))

    def _abort(self, msg: AbortReqMsg) -> None:
        self.scheduler.abort(msg.rid)  # (hooks drop what they hold of the request too)

    def _flush(self, msg: FlushCacheReqMsg) -> None:
        flushed = self.scheduler.flush_cache()
        images = self.scheduler.runner.mm
        if flushed and images is not None:
            images.cache.clear()  # vision features too: a flushed server encodes every image again
        self.reply(msg.query_id, {"success": flushed})

    def _shutdown(self, msg: ShutdownReqMsg) -> None:
        self.stopping = True

    def reply(self, query_id: str, result: dict[str, Any]) -> None:
        self.send.send(encoder.encode(QueryOutMsg(query_id, result)))
