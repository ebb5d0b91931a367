"""The scheduler process's loop (scheduler/loop.py) over a stand-in scheduler: messages routed by type, replies,
a feature's own messages, KV events sent after each step, and the real loop over ZMQ with a real scheduler."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import zmq

from radixmesh.engine.scheduler.loop import SchedulerLoop
from radixmesh.wire.disagg import ReleaseTransferMsg
from radixmesh.wire.kv_events import BlocksStored, KVEventsMsg
from radixmesh.wire.messages import (
    AbortReqMsg,
    BatchOutMsg,
    FlushCacheReqMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ServerInfoReqMsg,
    ShutdownReqMsg,
    encoder,
    from_scheduler_decoder,
)
from radixmesh.wire.sampling import SamplingParams

from .scheduler_factory import make_scheduler


class Sent:
    """Stands in for the PUSH socket: keeps what was sent, decoded."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, data: bytes, copy: bool = True) -> None:
        self.msgs.append(from_scheduler_decoder.decode(data))


class FakeScheduler:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.runner = SimpleNamespace(mm=None)
        self.flushes = True

    def add_request(self, req: Any) -> None:
        self.log.append(f"add {req.rid} {req.origin_input_ids} prefill_only={req.prefill_only}")

    def abort(self, rid: str) -> None:
        self.log.append(f"abort {rid}")

    def flush_cache(self) -> bool:
        self.log.append("flush")
        return self.flushes

    def stats(self) -> dict[str, Any]:
        return {"num_running_reqs": 0}


def make_loop() -> tuple[SchedulerLoop, FakeScheduler, Sent]:
    sched, sent = FakeScheduler(), Sent()
    return SchedulerLoop(sched, sent), sched, sent  # type: ignore[arg-type]


def test_requests_and_aborts_reach_the_scheduler() -> None:
    loop, sched, _ = make_loop()
    loop.handle(GenerateReqMsg("r", [1, 2], SamplingParams(max_new_tokens=2), prefill_only=True))
    loop.handle(AbortReqMsg("r"))
    assert sched.log == ["add r [1, 2] prefill_only=True", "abort r"]


def test_queries_are_answered_with_their_id() -> None:
    loop, sched, sent = make_loop()
    loop.handle(FlushCacheReqMsg("q1"))
    sched.flushes = False
    loop.handle(FlushCacheReqMsg("q2"))
    loop.handle(ServerInfoReqMsg("q3"))
    assert sent.msgs == [QueryOutMsg("q1", {"success": True}), QueryOutMsg("q2", {"success": False}),
                         QueryOutMsg("q3", {"num_running_reqs": 0})]


def test_a_flush_clears_the_vision_cache_only_when_the_kv_cache_flushed() -> None:
    loop, sched, _ = make_loop()
    cleared: list[bool] = []
    sched.runner.mm = SimpleNamespace(cache=SimpleNamespace(clear=lambda: cleared.append(True)),
                                      num_images_encoded=4)
    sched.flushes = False
    loop.handle(FlushCacheReqMsg("a"))
    assert cleared == []
    sched.flushes = True
    loop.handle(FlushCacheReqMsg("b"))
    assert cleared == [True]
    assert loop.info() == {"num_running_reqs": 0, "num_images_encoded": 4}


def test_a_feature_routes_its_own_messages_and_unknown_ones_are_ignored() -> None:
    loop, sched, _ = make_loop()
    got: list[Any] = []
    loop.handle(ReleaseTransferMsg("tx"))  # nobody registered for it yet: dropped
    loop.route((ReleaseTransferMsg,), got.append)
    loop.handle(ReleaseTransferMsg("tx"))
    assert got == [ReleaseTransferMsg("tx")] and sched.log == []


def test_shutdown_stops_the_loop() -> None:
    loop, _, _ = make_loop()
    assert not loop.stopping
    loop.handle(ShutdownReqMsg())
    assert loop.stopping


def test_kv_events_are_sent_once_drained() -> None:
    sent = Sent()
    recorder = SimpleNamespace(events=[KVEventsMsg([BlocksStored([7])], 16), None])
    recorder.drain = lambda: recorder.events.pop(0)
    loop = SchedulerLoop(FakeScheduler(), sent, recorder)  # type: ignore[arg-type]
    loop._send_kv_events()
    loop._send_kv_events()  # nothing new: nothing sent
    assert sent.msgs == [KVEventsMsg([BlocksStored([7])], 16)]


def test_the_loop_serves_a_real_scheduler_over_zmq() -> None:
    sched, _ = make_scheduler()
    ctx: zmq.Context[Any] = zmq.Context.instance()
    recv, to_sched = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = recv.bind_to_random_port("tcp://127.0.0.1")
    to_sched.connect(f"tcp://127.0.0.1:{port}")
    sent = Sent()
    sched.emit = lambda outputs: sent.send(encoder.encode(BatchOutMsg(outputs)))
    loop = SchedulerLoop(sched, sent)  # type: ignore[arg-type]
    runner = threading.Thread(target=loop.run, args=(recv,), daemon=True)

    def outputs() -> list[Any]:
        return [out for m in list(sent.msgs) if isinstance(m, BatchOutMsg) for out in m.outputs]

    try:
        runner.start()
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        to_sched.send(encoder.encode(GenerateReqMsg("r", [1, 2, 3], params)))
        deadline = time.monotonic() + 120
        while not any(out.finish_reason for out in outputs()):
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
        to_sched.send(encoder.encode(ServerInfoReqMsg("info")))
        to_sched.send(encoder.encode(ShutdownReqMsg()))
        runner.join(timeout=60)
        assert not runner.is_alive(), "the loop did not stop"
    finally:
        recv.close(0)
        to_sched.close(0)
    assert len([t for out in outputs() for t in out.token_ids]) == 4 and outputs()[-1].finish_reason == "length"
    replies = [m for m in sent.msgs if isinstance(m, QueryOutMsg)]
    assert [r.query_id for r in replies] == ["info"] and replies[0].result["max_total_num_tokens"] == 4096
