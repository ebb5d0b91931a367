"""Ranks 1..N-1 of a tensor-parallel worker: `python -m radixmesh.engine.distributed.follower`.

Started by rank 0 (`TpLeader`) with a pickled `RankSpec` on stdin. A rank builds its shard of the
model, then runs what rank 0 tells it, message by message: forward passes (the same
`ModelRunner.forward` as rank 0, on a batch rebuilt from `StepMsg`), the sampled tokens, KV
gathers and scatters. It schedules nothing and samples nothing. It exits on `StopMsg`, or when
rank 0's process is gone.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import sys
import traceback

import torch
import zmq

from radixmesh.engine.attention.base import ForwardMode
from radixmesh.engine.batch import PromptLogprobPlan, ScheduleBatch
from radixmesh.engine.distributed.comm import TorchCommunicator, rank_device
from radixmesh.engine.distributed.kv_pool import gather_shards, scatter_own_heads
from radixmesh.engine.distributed.layout import ShardLayout
from radixmesh.engine.distributed.leader import RankSpec
from radixmesh.engine.distributed.messages import (
    KVGatherMsg,
    KVScatterMsg,
    LoraSlotMsg,
    RankStatusMsg,
    StepMsg,
    StopMsg,
    TokensMsg,
    encoder,
    to_rank_decoder,
)
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.model_runner import ModelRunner
from radixmesh.engine.request import Req
from radixmesh.wire.sampling import SamplingParams

PARENT_CHECK_MS = 1000
_PLACEHOLDER = Req(rid="", origin_input_ids=[0], params=SamplingParams())
"""Stands for each request of a rebuilt batch (the forward pass only counts them)."""


def _placeholder(lora_slot: int) -> Req:
    """A stand-in request that carries its LoRA slot (the pass reads it)."""
    return Req(rid="", origin_input_ids=[0], params=_PLACEHOLDER.params, lora_slot=lora_slot)


@functools.cache
def _rank_placeholder(dp_rank: int) -> Req:
    """A stand-in request that carries its data-parallel attention rank (the pass runs its own rank's)."""
    return Req(rid="", origin_input_ids=[0], params=_PLACEHOLDER.params, dp_rank=dp_rank)


class FollowerLink:
    """A rank's end of the startup handshake: `ModelRunner` reports its stages through it."""

    def __init__(self, tp: TensorParallel, status: zmq.Socket) -> None:
        self.tp, self._status = tp, status

    def stage(self, stage: str) -> None:
        self._status.send(encoder.encode(RankStatusMsg(self.tp.rank, stage)))


class FollowerLoop:
    def __init__(self, runner: ModelRunner, comm: TorchCommunicator, recv: zmq.Socket) -> None:
        self.runner, self.comm, self.recv = runner, comm, recv
        self.layout = ShardLayout.of(runner.model_config, comm.rank, comm.size, runner.tp.dp_attention)
        self.num_steps = 0

    def run(self) -> None:
        parent = os.getppid()
        while True:
            if not self.recv.poll(PARENT_CHECK_MS):
                if os.getppid() != parent:
                    logging.warning("tensor-parallel rank 0 is gone; rank %d stops", self.comm.rank)
                    return
                continue
            msg = to_rank_decoder.decode(self.recv.recv())
            if isinstance(msg, StopMsg):
                return
            self.handle(msg)

    def handle(self, msg: StepMsg | TokensMsg | KVGatherMsg | KVScatterMsg | LoraSlotMsg) -> None:
        if isinstance(msg, StepMsg):
            self.forward(msg)
        elif isinstance(msg, LoraSlotMsg):
            self.lora_slot(msg)
        elif isinstance(msg, TokensMsg):
            self.runner.last_tokens = self._receive(msg.num_tokens, torch.int64)
        elif isinstance(msg, KVGatherMsg):
            slots = self._receive(msg.num_tokens, torch.int64)
            gather_shards(self.runner.kv_pool, self.comm, slots, msg.num_layers, msg.layer_begin)
        else:
            pool = self.runner.kv_pool
            slots = self._receive(msg.num_tokens, torch.int64)
            shape = (msg.num_layers, 2, msg.num_tokens, self.layout.total_kv_heads, pool.head_dim)
            src = self.comm.broadcast(torch.empty(shape, dtype=pool.dtype, device=pool.device))
            scatter_own_heads(pool, self.layout, slots, src, msg.layer_begin)

    def forward(self, msg: StepMsg) -> None:
        """The pass rank 0 runs now: apply its `req_to_token` writes, rebuild its batch, run the model."""
        runner = self.runner
        payload = self._receive(msg.num_slots + sum(n for _, _, n in msg.journal), torch.int64)
        if msg.dp_ranks is not None:  # rank 0 numbers every rank's pool in one space: this pool's slots (dp_kv)
            payload = payload % (runner.kv_pool.size + 1)
        offset = msg.num_slots
        for row, start, n in msg.journal:
            runner.req_pool.req_to_token[row, start:start + n] = payload[offset:offset + n]
            offset += n
        plan = PromptLogprobPlan(msg.logit_rows, [], [], []) if msg.logit_rows else None
        reqs = [_PLACEHOLDER] * len(msg.req_pool_indices)
        if msg.lora_slots is not None:
            reqs = [_placeholder(slot) for slot in msg.lora_slots]
        if msg.dp_ranks is not None:
            reqs = [_rank_placeholder(rank) for rank in msg.dp_ranks]
        batch = ScheduleBatch(ForwardMode(msg.mode), reqs, msg.input_ids,
                              msg.positions, payload[:msg.num_slots], msg.prefix_lens, msg.extend_lens,
                              msg.req_pool_indices, msg.future_rows, plan)
        runner.forward(batch)  # the logits are rank 0's to sample
        self.num_steps += 1

    def lora_slot(self, msg: LoraSlotMsg) -> None:
        """Rank 0 loaded an adapter into a slot (or emptied it): the same here, with this rank's shard."""
        lora = self.runner.lora
        assert lora is not None, "a LoRA slot message on a rank without adapter slots"
        if msg.path is None:
            lora.clear(msg.slot)
            return
        from radixmesh.engine.lora.adapter import load_adapter

        config = self.runner.config
        lora.write(msg.slot, load_adapter(msg.name, msg.path, self.runner.model_config, config.max_lora_rank))

    def _receive(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(n, dtype=dtype, device=self.runner.device)
        return self.comm.broadcast(buf) if n else buf


def run_rank(spec: RankSpec) -> int:
    """Build this rank's shard of the model and follow rank 0 until told to stop; the exit code."""
    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.connect(spec.status_addr)
    recv = ctx.socket(zmq.PULL)
    recv.connect(spec.recv_addr)
    status.send(encoder.encode(RankStatusMsg(spec.rank, "started")))
    code = 0
    runner: ModelRunner | None = None
    try:
        device = rank_device(spec.config.device, spec.rank)
        comm = TorchCommunicator.init(spec.rank, spec.config.tp_size, spec.init_method, device,
                                      spec.config.enable_custom_all_reduce)
        tp = TensorParallel(spec.rank, spec.config.tp_size, comm, spec.config.ep_size, spec.config.enable_dp_attention)
        link = FollowerLink(tp, status)
        runner = ModelRunner(spec.config, spec.prepared, link)
        FollowerLoop(runner, comm, recv).run()
    except Exception as exc:
        traceback.print_exc()
        status.send(encoder.encode(RankStatusMsg(spec.rank, "failed", f"{type(exc).__name__}: {exc}")))
        code = 1
    finally:
        recv.close(0)
        status.close(linger=1000)
        ctx.term()
        if runner is not None:
            runner.release_graphs()  # before leaving the group, as rank 0 does
        TorchCommunicator.destroy()
    return code


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    spec: RankSpec = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=spec.config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(message)s")
    return run_rank(spec)


if __name__ == "__main__":
    sys.exit(main())
