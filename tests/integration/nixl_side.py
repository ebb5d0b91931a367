"""One side of a nixl KV transfer in its own process, for fault tests: a CPU KV pool (random contents) and the
nixl transport, driven over a pipe. The test process stops and kills it as a worker would die."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

REPLY_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0
"""Spawning imports torch and starts UCX: a loaded 2-core machine can take a minute or more."""


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    size: int = 1024
    mode: str = "auto"
    """The nixl transport's mode (auto | direct | staging)."""


def _serve(conn: Connection, shape: PoolShape, seed: int) -> None:
    import msgspec
    import torch

    from radixmesh.engine.disagg.bench_transfer_peer import fingerprint
    from radixmesh.engine.disagg.transport.choice import encode_receiver_info, local_info
    from radixmesh.engine.disagg.transport.nixl import NixlKVTransport
    from radixmesh.engine.disagg.transport.nixl_lib import NixlOptions
    from radixmesh.engine.memory import TokenToKVPool

    pool = TokenToKVPool(shape.size, shape.num_layers, shape.kv_heads, shape.head_dim, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=generator))
    transport = NixlKVTransport(pool, options=NixlOptions(mode=shape.mode))
    pending: Any = None
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "export":
            transfer_id, slots, receiver_params, lease_s = args
            from radixmesh.engine.disagg.transport.choice import decode_receiver_info

            transport.export(transfer_id, torch.tensor(slots), decode_receiver_info(receiver_params))
            (chunk,) = transport.ready_to_send(transfer_id) or []
            conn.send(msgspec.structs.replace(chunk, lease_s=lease_s))
        elif command == "receive":
            chunk, slots = args
            pending = transport.receive(chunk, torch.tensor(slots))
            conn.send(pending.state)
        elif command == "wait":
            pending.wait()
            conn.send(pending.state)
        elif command == "release":
            transport.release(args[0])
            conn.send(None)
        elif command == "fingerprint":
            conn.send(fingerprint(pool, torch.tensor(args[0])))
        elif command == "info":
            conn.send(encode_receiver_info(local_info("cpu", None, transport.receiver_agents())))
        elif command == "stats":
            conn.send(transport.stats())
        else:
            conn.send(None)
            return


def _main(conn: Connection, shape: PoolShape, seed: int) -> None:
    try:
        _serve(conn, shape, seed)
    finally:
        conn.close()


class NixlSide:
    """The process, seen from the test: `call` sends a command and returns its answer."""

    def __init__(self, shape: PoolShape, seed: int = 0) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.proc = context.Process(target=_main, args=(child, shape, seed), name="nixl-side", daemon=True)
        self.proc.start()
        child.close()
        assert self._reply(START_TIMEOUT_S) == "ready"

    def call(self, command: str, *args: Any) -> Any:
        self._conn.send((command, *args))
        return self._reply()

    def _reply(self, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the nixl side did not answer in {timeout_s:.0f} s")
        return self._conn.recv()

    def stop(self) -> None:
        """SIGSTOP: it holds its connections but answers nothing (no UCX progress either)."""
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self._conn.close()

    def close(self) -> None:
        if self.proc.is_alive():
            self.resume()
            with contextlib.suppress(OSError, TimeoutError, EOFError):
                self.call("stop")
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self._conn.close()
