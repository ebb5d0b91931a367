"""`grpc`: the KV bytes themselves ride the workers' gRPC Prefill call. Works anywhere (CPU too).

Export gathers the slots' KV into one contiguous buffer on the pool's device, copies it to the
host and cuts it into layer ranges; receive copies a range to the device and scatters it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixmesh.common.errors import invalid_argument
from radixmesh.engine.disagg import kv_io
from radixmesh.engine.disagg.transport.base import BaseKVTransport, PendingReceive, dtype_name
from radixmesh.wire.disagg import KVChunk

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.choice import ReceiverInfo


class GrpcKVTransport(BaseKVTransport):
    transport_id = "grpc"

    def export(self, transfer_id: str, slots: torch.Tensor, receiver: ReceiverInfo | None = None) -> list[KVChunk]:
        pool, num_tokens = self.pool, slots.shape[0]
        packed = torch.empty(kv_io.packed_shape(pool, pool.num_layers, num_tokens), dtype=pool.dtype,
                             device=pool.device)
        kv_io.gather(pool, slots, packed)
        packed_cpu = packed.cpu()
        chunks = []
        for begin, end in self.layer_groups(num_tokens):
            data = packed_cpu[begin:end].view(torch.uint8).numpy().tobytes()  # [layers, 2, tokens, heads, dim]
            chunks.append(KVChunk(self.transport_id, begin, end, num_tokens, dtype_name(pool.dtype), data, len(data)))
        return chunks

    def receive(self, chunk: KVChunk, slots: torch.Tensor, host_slots: Any = None) -> PendingReceive | None:
        self.check_chunk(chunk, slots.shape[0])
        pool = self.pool
        shape = kv_io.packed_shape(pool, chunk.layer_end - chunk.layer_begin, chunk.num_tokens)
        expected = self.layer_token_bytes * shape[0] * chunk.num_tokens
        if len(chunk.data) != expected:
            raise invalid_argument(f"the chunk has {len(chunk.data)} bytes of KV; layers "
                                   f"[{chunk.layer_begin}, {chunk.layer_end}) of {chunk.num_tokens} tokens are "
                                   f"{expected} here (do both workers run the same model?)")
        raw = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        packed = raw.view(pool.dtype).reshape(shape).to(pool.device)
        kv_io.scatter(pool, slots, packed, chunk.layer_begin)
        return None
