"""A decode worker's gRPC channels to prefill workers: one per address, opened on first use."""

from __future__ import annotations

import asyncio

import grpc.aio

from radixmesh.common import tls, tracing
from radixmesh.common.grpc_server import MAX_MESSAGE_BYTES
from radixmesh.protocol import worker_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
MAX_CHANNELS = 256
"""Channels kept open at most (the least recently opened one is closed beyond)."""


class PrefillPeers:
    """WorkerService stubs of prefill workers by host:port."""

    def __init__(self) -> None:
        self._channels: dict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._closing: set[asyncio.Future[None]] = set()

    def stub(self, address: str) -> worker_pb2_grpc.WorkerServiceStub:
        entry = self._channels.get(address)
        if entry is None:
            if len(self._channels) >= MAX_CHANNELS:
                oldest = next(iter(self._channels))
                channel, _ = self._channels.pop(oldest)
                task = asyncio.ensure_future(channel.close(grace=30.0))  # open calls on it may finish
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            channel = tls.aio_channel(address, options=CHANNEL_OPTIONS, interceptors=tracing.client_interceptors())
            entry = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel, _ in channels:
            await channel.close()
