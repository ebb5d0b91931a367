"""What one gRPC hop costs a streamed request on this host, with nothing else running: the floor under the
services path's extra time to first token (issue 18).

A server process answers WorkerService-shaped streams at once (one message, then a second 2 ms later); a client
process in another process sends GenerateRequests of a given prompt length, one at a time with a pause between,
and times the first message:

- `new_call`: a new unary-stream call per request (what the gateway and the router do), split into
  send -> handler start and handler's first message -> client (one clock: both processes on this host);
- `open_call`: the request written into a bidirectional call opened beforehand (call setup off the path);
- `shared_stream`: the request sent as one more message on a long-lived bidirectional stream that carries every
  request and every answer (no call per request at all);
- `lane`: the request as a stream on the project's Generate lane (`radixmesh.common.lane`: one plain TCP
  connection, no gRPC), what the services use between each other when it is on.

    python3 scripts/grpc_hop_bench.py [--prompt-lens 16,4096] [--requests 300] [--out hop.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from radixmesh.common.lane import LaneClient, LaneMethod, LaneServer
from radixmesh.protocol import worker_pb2

SERVICE = "hopbench.Hop"
SECOND_MESSAGE_DELAY_S = 0.002
PAUSE_S = 0.02
WARMUP = 20


def _serialize(msg: Any) -> bytes:
    return bytes(msg.SerializeToString())


async def _answer(request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
    arrived_ns = time.time_ns()
    ids = list(request.token_ids)  # as a worker does
    yield worker_pb2.GenerateResponse(request_id=str(arrived_ns), token_ids=[len(ids) % 7],
                                      worker_id=str(time.time_ns()))
    await asyncio.sleep(SECOND_MESSAGE_DELAY_S)
    yield worker_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1])


async def _unary_stream(request: worker_pb2.GenerateRequest, context: Any) -> AsyncIterator[Any]:
    async for msg in _answer(request):
        yield msg


async def _bidi(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
    request = await context.read()
    if request is grpc.aio.EOF:  # the spare call the client cancelled at the end
        return
    async for msg in _answer(request):
        yield msg


async def _shared(request_iterator: Any, context: Any) -> AsyncIterator[Any]:
    """Every request on one stream; each answer carries its request's id in matched_stop_str (the tag)."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()

    async def one(request: worker_pb2.GenerateRequest) -> None:
        async for msg in _answer(request):
            msg.matched_stop_str = request.request_id
            await out.put(msg)

    async def read() -> None:
        async for request in request_iterator:
            task = asyncio.get_running_loop().create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await out.put(None)

    reader = asyncio.get_running_loop().create_task(read())
    while (msg := await out.get()) is not None:
        yield msg
    await reader


async def _serve(port: int, lane_port: int) -> None:
    lane = LaneServer({"Generate": LaneMethod(worker_pb2.GenerateRequest, _unary_stream, f"{SERVICE}/Generate")},
                      "hopbench")
    await lane.start("127.0.0.1", lane_port)
    server = grpc.aio.server()
    decode = worker_pb2.GenerateRequest.FromString
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "New": grpc.unary_stream_rpc_method_handler(_unary_stream, request_deserializer=decode,
                                                    response_serializer=_serialize),
        "Open": grpc.stream_stream_rpc_method_handler(_bidi, request_deserializer=decode,
                                                      response_serializer=_serialize),
        "Shared": grpc.stream_stream_rpc_method_handler(_shared, request_deserializer=decode,
                                                        response_serializer=_serialize)}),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _server_main(port: int, lane_port: int) -> None:
    asyncio.run(_serve(port, lane_port))


def _median_ms(values_ns: list[int]) -> float:
    return statistics.median(values_ns[WARMUP:]) / 1e6


async def _drain(call: Any) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass


async def _measure(port: int, lane_port: int, prompt_len: int, requests: int) -> dict[str, Any]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    lane = LaneClient("127.0.0.1", lane_port, "hopbench")
    decode = worker_pb2.GenerateResponse.FromString
    new = channel.unary_stream(f"/{SERVICE}/New", request_serializer=_serialize, response_deserializer=decode)
    opened = channel.stream_stream(f"/{SERVICE}/Open", request_serializer=_serialize, response_deserializer=decode)
    request = worker_pb2.GenerateRequest(request_id="r", token_ids=list(range(1000, 1000 + prompt_len)))
    request.block_hashes.hashes.extend(range(1 << 62, (1 << 62) + prompt_len // 16))
    shared = channel.stream_stream(f"/{SERVICE}/Shared", request_serializer=_serialize,
                                   response_deserializer=decode)()
    total, to_handler, back, warm, muxed, laned = [], [], [], [], [], []
    lane_to_handler, lane_back = [], []
    spare = opened()
    await asyncio.sleep(PAUSE_S)
    for _ in range(requests):
        sent = time.time_ns()
        call = new(request)
        first = await call.read()
        received = time.time_ns()
        await _drain(call)
        total.append(received - sent)
        to_handler.append(int(first.request_id) - sent)
        back.append(received - int(first.worker_id))
        await asyncio.sleep(PAUSE_S)
        sent = time.time_ns()
        call, spare = spare, opened()
        await call.write(request)
        await call.done_writing()
        await call.read()
        warm.append(time.time_ns() - sent)
        await _drain(call)
        await asyncio.sleep(PAUSE_S)
        sent = time.time_ns()
        await shared.write(request)
        await shared.read()
        muxed.append(time.time_ns() - sent)
        await shared.read()  # its second message
        await asyncio.sleep(PAUSE_S)
        sent = time.time_ns()
        stream = await lane.open("Generate", request, worker_pb2.GenerateResponse)
        first = await stream.read()
        received = time.time_ns()
        assert first is not None
        laned.append(received - sent)
        lane_to_handler.append(int(first.request_id) - sent)
        lane_back.append(received - int(first.worker_id))
        while await stream.read() is not None:
            pass
        await asyncio.sleep(PAUSE_S)
    await shared.done_writing()
    await _drain(shared)
    spare.cancel()
    await asyncio.sleep(PAUSE_S)
    await channel.close()
    await lane.close()
    return {"prompt_len": prompt_len, "requests": requests,
            "new_call_first_message_ms": _median_ms(total), "new_call_send_to_handler_ms": _median_ms(to_handler),
            "new_call_handler_to_client_ms": _median_ms(back), "open_call_first_message_ms": _median_ms(warm),
            "shared_stream_first_message_ms": _median_ms(muxed),
            "lane_first_message_ms": _median_ms(laned), "lane_send_to_handler_ms": _median_ms(lane_to_handler),
            "lane_handler_to_client_ms": _median_ms(lane_back)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", default="16,4096", help="comma-separated prompt lengths (token ids)")
    parser.add_argument("--requests", type=int, default=300, help="requests per prompt length")
    parser.add_argument("--port", type=int, default=0, help="server port (0 picks a free one)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    port, lane_port = args.port or _free_port(), _free_port()
    server = multiprocessing.get_context("spawn").Process(target=_server_main, args=(port, lane_port), daemon=True)
    server.start()
    try:
        time.sleep(1.5)
        results = [asyncio.run(_measure(port, lane_port, int(n), args.requests)) for n in args.prompt_lens.split(",")]
    finally:
        server.kill()
    for r in results:
        print(f"prompt {r['prompt_len']:>5} ids: new call, first message {r['new_call_first_message_ms']:.3f} ms "
              f"(send -> handler {r['new_call_send_to_handler_ms']:.3f}, handler -> client "
              f"{r['new_call_handler_to_client_ms']:.3f}); call opened beforehand "
              f"{r['open_call_first_message_ms']:.3f} ms; one shared stream "
              f"{r['shared_stream_first_message_ms']:.3f} ms; lane {r['lane_first_message_ms']:.3f} ms "
              f"(send -> handler {r['lane_send_to_handler_ms']:.3f}, handler -> client "
              f"{r['lane_handler_to_client_ms']:.3f})")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
