"""The decode-side process of `radixmesh bench kv-transfer`, and what both sides of the benchmark share.

The receiver owns a KV pool and a transport like a decode worker's scheduler. It answers the sender
(the benchmark's own process, the prefill side) over a multiprocessing pipe, one msgpack message at a
time: `PrepareMsg` (zero the pool, draw the slots of the next size; the reply describes this side for
the export, as a decode worker's grant does), `ChunkMsg`s (receive; after the last one finish,
synchronize and report the time spent), `CheckMsg` (a fingerprint of the KV at its slots),
`BareReadMsg` (nixl's baseline: `bench_transfer_nixl`), `StopMsg`. Every request gets one `ReplyMsg`;
a failure comes back as its `error`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from radixmesh.engine.disagg.bench_transfer_nixl import BareReadMsg, BareReceiver
from radixmesh.engine.disagg.transport.base import BaseKVTransport
from radixmesh.engine.disagg.transport.registry import create_transport
from radixmesh.engine.memory import TokenToKVPool
from radixmesh.wire.disagg import KVChunk

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float8_e4m3fn": torch.float8_e4m3fn}
_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_WEIGHT_PERIOD = 8191
"""Weights of the fingerprint cycle through 1..8191: position-dependent, and small enough for int64 sums."""


class PoolSpec(msgspec.Struct, frozen=True):
    """One side's KV pool and transport."""

    device: str
    """torch device of the pool, e.g. cuda:1 (that device becomes the process's current one)."""
    size: int
    """Usable slots of the pool (more than any size's tokens, so the slots drawn are scattered)."""
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    """A key of KV_DTYPES."""
    transport: str
    """A KV transport id of the registry."""
    mode: str = ""
    """The transport's mode option (cuda-ipc: direct | staging; nixl: auto | direct | staging); "" its default."""


class PrepareMsg(msgspec.Struct, tag="prepare", frozen=True):
    num_tokens: int
    seed: int
    contiguous: bool = False


class ChunkMsg(msgspec.Struct, tag="chunk", frozen=True):
    chunk: KVChunk
    last: bool
    """The transfer's last chunk: finish and reply."""


class CheckMsg(msgspec.Struct, tag="check", frozen=True):
    pass


class StopMsg(msgspec.Struct, tag="stop", frozen=True):
    pass


class ReplyMsg(msgspec.Struct, frozen=True):
    receive_s: float = 0.0
    """Seconds in `receive` and `finish` (device work synchronized) of the transfer that just ended."""
    sums: list[int] = []
    """Per layer, the fingerprint of the KV at the receiver's slots (answering CheckMsg)."""
    error: str = ""
    """The receiver's traceback when it failed."""
    transport_params: bytes = b""
    """Answering PrepareMsg: this side's ReceiverInfo (nixl: the agents whose metadata it holds)."""
    times_s: list[float] = []
    """Answering BareReadMsg: seconds of each timed READ."""


ToReceiverMsg = PrepareMsg | ChunkMsg | CheckMsg | BareReadMsg | StopMsg
encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(ReplyMsg)
_request_decoder = msgspec.msgpack.Decoder(ToReceiverMsg)
REPLY_TIMEOUT_S = 600.0


def open_side(spec: PoolSpec, **options: Any) -> tuple[TokenToKVPool, BaseKVTransport]:
    """The pool (zeroed) and transport (`options` go to its constructor) of one side, its device made current
    (Triton launches there)."""
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = TokenToKVPool(spec.size, spec.num_layers, spec.kv_heads, spec.head_dim, KV_DTYPES[spec.dtype], device)
    if spec.mode and "mode" not in options:
        options = {**options, "mode": spec.mode}
    return pool, create_transport(spec.transport, pool, **options)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_slots(pool: TokenToKVPool, num_tokens: int, seed: int, contiguous: bool = False) -> torch.Tensor:
    """`num_tokens` distinct slots in random order, as a worker's allocator hands out after a while (or one run
    from a random place, as a fresh pool hands out)."""
    generator = torch.Generator().manual_seed(seed)
    if contiguous:
        first = int(torch.randint(0, pool.size - num_tokens + 1, (1,), generator=generator))
        return torch.arange(first + 1, first + 1 + num_tokens, device=pool.device)
    return (torch.randperm(pool.size, generator=generator)[:num_tokens] + 1).to(pool.device)


def fill_random(pool: TokenToKVPool, seed: int) -> None:
    torch.manual_seed(seed)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, device=buf.device))


def fingerprint(pool: TokenToKVPool, slots: torch.Tensor) -> list[int]:
    """Per layer, an exact checksum of the bits of K and V at `slots` (in their order), weighted by position.

    Plain indexing, not the transfer kernels: a fault shared by gather and scatter cannot cancel out.
    """
    bits_dtype = _BITS_DTYPES[pool.dtype.itemsize]
    sums = []
    for k_buf, v_buf in zip(pool.k_buffers, pool.v_buffers):
        # [2 * tokens * heads * dim], integer views (FP8 has few indexing kernels)
        bits = torch.stack([k_buf.view(bits_dtype)[slots], v_buf.view(bits_dtype)[slots]]).flatten().long()
        weights = torch.arange(bits.numel(), device=bits.device) % _WEIGHT_PERIOD + 1
        sums.append(int((bits * weights).sum()))
    return sums


class Receiver:
    """The receiver process, seen from the sender: requests go out, one reply comes back for each."""

    def __init__(self, spec: PoolSpec) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA IPC handles open only in another process
        self._conn, child_conn = context.Pipe()
        self._proc = context.Process(target=receiver_main, args=(child_conn, spec), name="kv-transfer-receiver",
                                     daemon=True)
        self._proc.start()
        child_conn.close()

    def send(self, msg: ToReceiverMsg) -> None:
        self._conn.send_bytes(encoder.encode(msg))

    def request(self, msg: ToReceiverMsg) -> ReplyMsg:
        self.send(msg)
        return self.reply()

    def reply(self) -> ReplyMsg:
        """The next reply; RuntimeError when the receiver failed, died or went silent."""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self._conn.poll(0.5):
            if not self._proc.is_alive():
                raise RuntimeError(f"the receiver process exited with code {self._proc.exitcode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the receiver process did not answer in {REPLY_TIMEOUT_S:.0f} s")
        reply = reply_decoder.decode(self._conn.recv_bytes())
        if reply.error:
            raise RuntimeError(f"the receiver process failed:\n{reply.error}")
        return reply

    def stop(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self.send(StopMsg())
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._conn.close()


def _receiver_params(transport: BaseKVTransport) -> bytes:
    from radixmesh.engine.disagg.transport.choice import ReceiverInfo, encode_receiver_info

    agents = getattr(transport, "receiver_agents", None)
    return encode_receiver_info(ReceiverInfo(nixl_agents=agents())) if agents is not None else b""


def receiver_main(conn: Connection, spec: PoolSpec) -> None:
    """Entry point of the receiver process (multiprocessing 'spawn')."""
    try:
        pool, transport = open_side(spec)
        _serve(conn, pool, transport)
    except Exception:  # the sender raises it: a failing receiver must not leave it waiting
        conn.send_bytes(encoder.encode(ReplyMsg(error=traceback.format_exc())))
    finally:
        conn.close()


def _serve(conn: Connection, pool: TokenToKVPool, transport: BaseKVTransport) -> None:
    slots = torch.empty(0, dtype=torch.int64, device=pool.device)
    receive_s, bare = 0.0, None
    while True:
        msg = _request_decoder.decode(conn.recv_bytes())
        if isinstance(msg, StopMsg):
            return
        if isinstance(msg, PrepareMsg):
            for buf in (*pool.k_buffers, *pool.v_buffers):
                buf.zero_()
            slots = random_slots(pool, msg.num_tokens, msg.seed, msg.contiguous)
            synchronize(pool.device)
            reply = ReplyMsg(transport_params=_receiver_params(transport))
        elif isinstance(msg, BareReadMsg):
            bare = bare or BareReceiver(pool.device)
            reply = ReplyMsg(times_s=bare.read(msg))
        elif isinstance(msg, ChunkMsg):
            start = time.perf_counter()
            transport.receive(msg.chunk, slots)
            if msg.last:
                transport.finish()  # cuda-ipc staging: drops the mapping of the sender's staging buffer
                synchronize(pool.device)
            receive_s += time.perf_counter() - start
            if not msg.last:
                continue
            reply, receive_s = ReplyMsg(receive_s=receive_s, transport_params=_receiver_params(transport)), 0.0
        else:
            reply = ReplyMsg(sums=fingerprint(pool, slots))
        conn.send_bytes(encoder.encode(reply))
