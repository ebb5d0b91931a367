"""`radixmesh serve`'s front end over a stub scheduler process, for measuring the front end alone.

Everything a request meets before the scheduler holds its token ids runs as in `serve` (uvicorn, the app,
`LocalEngineBackend` and its tokenizer pool, `EngineClient`, the ZMQ channel, msgspec on both ends); only
the scheduler process is replaced by one that decodes each request, notes when it arrived
(`time.monotonic_ns()`, the clock every process on the machine shares) in a record file, and answers with
one token at once, or with `--itl-ms` streams each request's max_new_tokens tokens, one step every ITL ms.
`radixmesh bench front-end` and `bench front-end-load` start it as

    python -m radixmesh.gateway.stub_scheduler --port P --record FILE [--model M] [--tokenizer-workers N] [--itl-ms T]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import zmq

from radixmesh.common.aio import run_main
from radixmesh.engine.client import EngineClient
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.hf_tokenizer import load_tokenizer
from radixmesh.engine.loader import prepare_model
from radixmesh.engine.tokenize_pool import DEFAULT_TOKENIZER_WORKERS
from radixmesh.wire.messages import (
    AbortReqMsg,
    BatchOutMsg,
    GenerateReqMsg,
    QueryOutMsg,
    ReadyMsg,
    ShutdownReqMsg,
    TokenOut,
    encoder,
    to_scheduler_decoder,
)

STUB_INFO = {"max_running_requests": 1024}
"""What the stub reports as its server info."""
STUB_TOKEN_BASE = 300
"""The streaming stub's tokens: ids from here on (ordinary vocabulary entries of the default model)."""


def run_stub_scheduler(recv_addr: str, send_addr: str, record_path: str, itl_ms: float = 0.0) -> None:
    """The stub's process: one record line per Generate (`arrived_ns decoded_ns num_input_ids`). With `itl_ms` 0
    each request gets one token back at once; otherwise every running request gets one token per step, a step
    every `itl_ms` (all of a step's tokens in one message, as the scheduler sends them), until its max_new_tokens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.connect(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    send.send(encoder.encode(ReadyMsg(dict(STUB_INFO))))
    steps = _Steps(itl_ms / 1e3)
    with open(record_path, "a", buffering=1) as record:
        while True:
            if steps.running and not recv.poll(steps.wait_ms()):
                outs = steps.step()
                if outs:
                    send.send(encoder.encode(BatchOutMsg(outs)))
                continue
            raw = recv.recv(copy=False)
            arrived_ns = time.monotonic_ns()
            msg = to_scheduler_decoder.decode(raw.buffer)
            decoded_ns = time.monotonic_ns()
            if isinstance(msg, ShutdownReqMsg):
                break
            if isinstance(msg, GenerateReqMsg):
                record.write(f"{arrived_ns} {decoded_ns} {len(msg.input_ids)}\n")
                if steps.itl_s > 0:
                    steps.add(msg)
                    continue
                out = TokenOut(msg.rid, [msg.input_ids[-1]], len(msg.input_ids), 0, 1, finish_reason="length",
                               admitted_at=time.time())
                send.send(encoder.encode(BatchOutMsg([out])))
            elif isinstance(msg, AbortReqMsg):
                steps.running.pop(msg.rid, None)
            elif hasattr(msg, "query_id"):
                send.send(encoder.encode(QueryOutMsg(msg.query_id, dict(STUB_INFO))))
    recv.close(0)
    send.close(linger=1000)
    ctx.term()


class _Steps:
    """The streaming stub's running requests: rid -> [prompt length, max_new_tokens, tokens sent]."""

    def __init__(self, itl_s: float) -> None:
        self.itl_s = itl_s
        self.running: dict[str, list[int]] = {}
        self.next_at = time.monotonic()

    def add(self, msg: GenerateReqMsg) -> None:
        if not self.running:
            self.next_at = time.monotonic() + self.itl_s
        self.running[msg.rid] = [len(msg.input_ids), max(1, msg.params.max_new_tokens), 0]

    def wait_ms(self) -> int:
        return max(0, round((self.next_at - time.monotonic()) * 1e3))

    def step(self) -> list[TokenOut]:
        self.next_at += self.itl_s
        outs = []
        for rid, state in list(self.running.items()):
            prompt_len, max_new_tokens, sent = state
            state[2] = sent + 1
            finished = sent + 1 >= max_new_tokens
            outs.append(TokenOut(rid, [STUB_TOKEN_BASE + sent % 1000], prompt_len, 0, sent + 1,
                                 finish_reason="length" if finished else None, admitted_at=time.time()))
            if finished:
                del self.running[rid]
        return outs


class StubSchedulerClient(EngineClient):
    """`EngineClient` whose scheduler process is `run_stub_scheduler`, recording into `record_path`."""

    def __init__(self, config: EngineConfig, prepared: Any, tokenizer: Any, record_path: str,
                 itl_ms: float = 0.0) -> None:
        super().__init__(config, prepared, tokenizer)
        self.record_path = record_path
        self.itl_ms = itl_ms

    def _scheduler_process(self, to_sched: str, from_sched: str) -> Any:
        return mp.get_context("spawn").Process(target=run_stub_scheduler, name="radixmesh-stub-scheduler",
                                               args=(to_sched, from_sched, self.record_path, self.itl_ms), daemon=True)

    @classmethod
    async def start_stub(cls, model: str | None, record_path: str, itl_ms: float = 0.0) -> StubSchedulerClient:
        """The model's config and tokenizer (no weights are read), and a started stub process."""
        config = EngineConfig(model=model, device="cpu", load_format="dummy").resolve()
        prepared = await asyncio.to_thread(prepare_model, config.model, config.load_format, tokenizer=config.tokenizer)
        assert prepared.tokenizer_path is not None, f"{model or 'the default model'} has no tokenizer"
        client = cls(config, prepared, await asyncio.to_thread(load_tokenizer, prepared.tokenizer_path), record_path,
                     itl_ms)
        await client._spawn()
        return client


def main() -> None:
    from radixmesh.gateway.config import GatewayConfig
    from radixmesh.gateway.local_backend import LocalEngineBackend
    from radixmesh.gateway.server import serve_backend

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="whose tokenizer and config the front end uses (default model)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", required=True, help="file the stub appends one line per request to")
    parser.add_argument("--tokenizer-workers", type=int, default=DEFAULT_TOKENIZER_WORKERS)
    parser.add_argument("--itl-ms", type=float, default=0.0,
                        help="stream max_new_tokens tokens per request, a step every ITL ms (0: one token at once)")
    args = parser.parse_args()
    config = GatewayConfig(host="127.0.0.1", port=args.port, tokenizer_workers=args.tokenizer_workers,
                           log_level="warning")

    async def start() -> LocalEngineBackend:
        client = await StubSchedulerClient.start_stub(args.model, os.path.abspath(args.record), args.itl_ms)
        return LocalEngineBackend(client, tokenizer_workers=args.tokenizer_workers)

    raise SystemExit(run_main(serve_backend(config, start, "starting the front end over a stub scheduler")))


if __name__ == "__main__":
    main()
