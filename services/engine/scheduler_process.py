"""Entry point of the scheduler process: builds the model and serves the local channel.

The client (engine front end) PUSHes typed requests; this process PUSHes batched
token outputs back. Nothing else shares this process's GIL.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.disagg.messages import DISAGG_MSG_TYPES
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.messages import (
    AbortReqMsg,
    BatchOutMsg,
    FatalMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ReadyMsg,
    ServerInfoReqMsg,
    ShutdownReqMsg,
    TokenOut,
    encoder,
    to_scheduler_decoder,
)
from radixmesh.engine.mm.runtime import ReqImages
from radixmesh.engine.request import Req

if TYPE_CHECKING:
    from radixmesh.engine.disagg.handler import DisaggHandler
    from radixmesh.engine.kv_events import BlockEventRecorder

IDLE_POLL_MS = 50


def run_scheduler_process(config: EngineConfig, prepared: PreparedModel, recv_addr: str,
                          send_addr: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s scheduler %(levelname)s %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    try:
        loop = _build(config, prepared, send)
    except RadixMeshError as exc:
        send.send(encoder.encode(FatalMsg(str(exc))))
        return
    except Exception as exc:  # any load failure must reach the client as one line
        traceback.print_exc()
        send.send(encoder.encode(FatalMsg(f"{type(exc).__name__}: {exc}")))
        return
    send.send(encoder.encode(ReadyMsg(loop.info())))
    try:
        loop.run(recv)
    except Exception as exc:
        traceback.print_exc()
        send.send(encoder.encode(FatalMsg(f"scheduler crashed: {type(exc).__name__}: {exc}")))
    finally:
        loop.scheduler.runner.close()  # stops the other tensor-parallel ranks
        recv.close(0)
        send.close(linger=1000)
        ctx.term()


def _build(config: EngineConfig, prepared: PreparedModel, send: zmq.Socket) -> SchedulerLoop:
    import torch

    from radixmesh.engine.disagg.handler import DisaggHandler
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler import Scheduler
    from radixmesh.engine.tokenizer import load_tokenizer

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    tokenizer = load_tokenizer(prepared.tokenizer_path) if prepared.tokenizer_path else None
    runner = ModelRunner(config, prepared)

    def emit(outputs: list[TokenOut]) -> None:
        send.send(encoder.encode(BatchOutMsg(outputs)), copy=False)

    scheduler = Scheduler(config, runner, tokenizer, emit)
    recorder = None
    if config.kv_events_block_size > 0:
        from radixmesh.engine.kv_events import BlockEventRecorder

        recorder = BlockEventRecorder(config.kv_events_block_size)
        scheduler.kv.tree.listener = recorder
    loop = SchedulerLoop(scheduler, send, recorder)
    loop.disagg = DisaggHandler(scheduler, lambda msg: send.send(encoder.encode(msg), copy=False), loop._reply)
    return loop


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
            if self.disagg is not None:
                self.disagg.tick()
            stepped = self.scheduler.step()
            if self.kv_events is not None:
                self._send_kv_events()
            if not stepped:
                poller.poll(IDLE_POLL_MS)
                if os.getppid() != parent_pid:
                    logging.warning("the front end process is gone (killed?); stopping")
                    return

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
