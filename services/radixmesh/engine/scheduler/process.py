"""Entry point of the scheduler process: builds the model and serves the local channel.

The client (engine front end) PUSHes typed requests; this process PUSHes batched
token outputs back. Nothing else shares this process's GIL. The front end imports this
module to name the process's target, so it imports no torch: the model side loads in the
process itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

import zmq

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.loader import PreparedModel
from radixmesh.wire.messages import BatchOutMsg, FatalMsg, ReadyMsg, TokenOut, encoder

if TYPE_CHECKING:
    from radixmesh.engine.scheduler.loop import SchedulerLoop


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
    _exit_at_once()


def _exit_at_once() -> None:
    """End the process without the interpreter's teardown. Everything that must be released is by now
    (sockets closed, the other ranks stopped); what is left is freeing torch's modules and tensors one by
    one, about a second of CPU that every stop of a server would otherwise wait for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _build(config: EngineConfig, prepared: PreparedModel, send: zmq.Socket) -> SchedulerLoop:
    import torch

    from radixmesh.engine.compile_watch import install_from_env
    from radixmesh.engine.disagg.handler import DisaggHandler
    from radixmesh.engine.hf_tokenizer import load_tokenizer
    from radixmesh.engine.model_runner import ModelRunner
    from radixmesh.engine.scheduler.core import Scheduler
    from radixmesh.engine.scheduler.loop import SchedulerLoop
    from radixmesh.engine.scheduler.warmup import wants_warmup, warm_up_prefill
    from radixmesh.wire.disagg import DISAGG_MSG_TYPES

    torch.set_num_threads(max(torch.get_num_threads(), 1))
    compile_watch = install_from_env()
    tokenizer = load_tokenizer(prepared.tokenizer_path) if prepared.tokenizer_path else None
    runner = ModelRunner(config, prepared)

    def emit(outputs: list[TokenOut]) -> None:
        send.send(encoder.encode(BatchOutMsg(outputs)), copy=False)

    scheduler = Scheduler(config, runner, tokenizer, emit)
    if wants_warmup(config, scheduler):
        warm_up_prefill(scheduler)
    if compile_watch is not None:
        compile_watch.mark_ready()
    recorder = None
    if config.kv_events_block_size > 0:
        from radixmesh.engine.kv_events import BlockEventRecorder

        recorder = BlockEventRecorder(config.kv_events_block_size)
        scheduler.kv.tree.listener = recorder
    loop = SchedulerLoop(scheduler, send, recorder)
    disagg = DisaggHandler(scheduler, lambda msg: send.send(encoder.encode(msg), copy=False), loop.reply)
    loop.route(DISAGG_MSG_TYPES, disagg.handle)
    from radixmesh.engine.lora.hook import LORA_MSG_TYPES, LoraHook

    lora = scheduler.hooks.get(LoraHook)
    if lora is not None:
        loop.route(LORA_MSG_TYPES, lambda msg: lora.handle(msg, loop.reply))
    return loop
