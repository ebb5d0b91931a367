"""Rank 0 of a tensor-parallel worker: starts ranks 1..N-1 and tells them what to run, step by step.

Only rank 0 schedules (radix cache, admission, grammars, sampling, disaggregation). Before each
forward pass it sends the other ranks the batch (`StepMsg`, host lists over ZMQ) and broadcasts
the batch's KV slots and `req_to_token` writes on the device; after sampling it broadcasts the
sampled tokens (the next step's future inputs). Every rank then runs the same model code with
the same inputs, so their collectives pair up. docs/tensor-parallel.md explains the choice.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import zmq

from radixmesh.common.errors import ErrorCode, RadixMeshError, invalid_argument
from radixmesh.engine.batch import ScheduleBatch
from radixmesh.engine.config import EngineConfig
from radixmesh.engine.distributed.comm import TorchCommunicator, rank_device
from radixmesh.engine.distributed.layout import ShardLayout, check_tensor_parallel
from radixmesh.engine.distributed.messages import (
    KVGatherMsg,
    KVScatterMsg,
    LoraSlotMsg,
    RankStatusMsg,
    StepMsg,
    StopMsg,
    TokensMsg,
    ToRankMsg,
    encoder,
    status_decoder,
)
from radixmesh.engine.distributed.sharding import TensorParallel
from radixmesh.engine.loader import PreparedModel
from radixmesh.engine.malloc_env import compute_env

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 900.0
"""How long rank 0 waits for the other ranks to start and to load their shards."""
TEARDOWN_TIMEOUT_S = 10.0
"""Longest wait for leaving the torch.distributed group at close."""
GROUP_LEFT_UNFINISHED = False
_OPEN: weakref.WeakSet[TpLeader] = weakref.WeakSet()
"""Leaders not closed yet (`close_open_leaders`)."""
"""Set when leaving the group timed out: torch's NCCL destructor, run at interpreter exit, would then abort the
process (SIGABRT, "Should never been called" in ProcessGroupNCCL::shutdown), so the CLI exits without it."""
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RankSpec:
    """What rank `rank` needs to start (pickled to its stdin)."""

    config: EngineConfig
    prepared: PreparedModel
    rank: int
    init_method: str
    """torch.distributed rendezvous (a file in rank 0's private directory)."""
    recv_addr: str
    """ZMQ address rank 0 pushes this rank's messages to."""
    status_addr: str
    """ZMQ address this rank reports its stages (or its failure) to."""


class TpLeader:
    """Rank 0's end of a tensor-parallel group: the rank processes, their channels and the collectives."""

    def __init__(self, config: EngineConfig, prepared: PreparedModel) -> None:
        self.config, self.prepared = config, prepared
        self.size = config.tp_size
        self.device = rank_device(config.device, 0)
        self.layout = ShardLayout.of(prepared.config, 0, self.size, config.enable_dp_attention)
        self._dir = tempfile.mkdtemp(prefix="radixmesh-tp-")
        self._ctx = zmq.Context()
        self._status = self._ctx.socket(zmq.PULL)
        self._status.bind(f"ipc://{self._dir}/status")
        self._sends: list[zmq.Socket] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._errors: dict[int, str] = {}
        self.comm: TorchCommunicator | None = None
        self.tp = TensorParallel(0, self.size, ep_size=config.ep_size, dp_attention=config.enable_dp_attention)
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig, prepared: PreparedModel) -> TpLeader:
        """Check the model splits, start ranks 1..N-1 and join the group with them (as rank 0)."""
        check_tensor_parallel(prepared.config, config.tp_size, config.ep_size, config.enable_dp_attention)
        if config.enable_custom_all_reduce and config.device != "cuda":
            raise invalid_argument("--enable-custom-all-reduce needs CUDA devices (CPU ranks all-reduce with gloo)",
                                   "enable_custom_all_reduce")
        if config.device == "cuda" and torch.cuda.device_count() < config.tp_size:
            raise invalid_argument(f"--tp-size {config.tp_size} needs {config.tp_size} GPUs; "
                                   f"{torch.cuda.device_count()} are visible", "tp_size")
        leader = cls(config, prepared)
        atexit.register(leader.close)
        _OPEN.add(leader)
        try:
            leader._spawn_ranks()
        except BaseException:
            leader.close()
            raise
        return leader

    def _spawn_ranks(self) -> None:
        init_method = f"file://{self._dir}/rendezvous"
        for rank in range(1, self.size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.bind(f"ipc://{self._dir}/rank-{rank}")
            self._sends.append(sock)
            spec = RankSpec(self.config, self.prepared, rank, init_method, f"ipc://{self._dir}/rank-{rank}",
                            f"ipc://{self._dir}/status")
            proc = subprocess.Popen([sys.executable, "-m", "radixmesh.engine.distributed.follower"],
                                    stdin=subprocess.PIPE, env=compute_env(self.config.device, os.environ))
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self._procs.append(proc)
        self.stage("started")
        self.comm = TorchCommunicator.init(0, self.size, init_method, self.device,
                                           self.config.enable_custom_all_reduce)
        self.tp = TensorParallel(0, self.size, self.comm, self.config.ep_size, self.config.enable_dp_attention)

    # ---- startup --------------------------------------------------------------------------------
    def stage(self, stage: str) -> None:
        """Wait until every other rank reported `stage`; a rank that failed or exited raises."""
        pending = set(range(1, self.size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise RadixMeshError(ErrorCode.UNAVAILABLE, f"tensor-parallel ranks {sorted(pending)} did not reach "
                                                            f"'{stage}' in {STARTUP_TIMEOUT_S:.0f} s")
            if self._status.poll(500):
                msg = status_decoder.decode(self._status.recv())
                if msg.error is not None:
                    raise RadixMeshError(ErrorCode.UNAVAILABLE, f"tensor-parallel rank {msg.rank} failed: {msg.error}")
                if msg.stage == stage:
                    pending.discard(msg.rank)
            else:
                self.check_ranks()

    def check_ranks(self) -> None:
        """Raise when a rank process has exited (its reported error, if any, in the message)."""
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                self._drain_status()
                detail = self._errors.get(rank, "no error reported")
                raise RadixMeshError(ErrorCode.UNAVAILABLE,
                                     f"tensor-parallel rank {rank} exited with code {code}: {detail}")

    def _drain_status(self) -> None:
        while self._status.poll(0):
            msg: RankStatusMsg = status_decoder.decode(self._status.recv())
            if msg.error is not None:
                self._errors[msg.rank] = msg.error

    # ---- per step -------------------------------------------------------------------------------
    def publish_forward(self, batch: ScheduleBatch, journal: list[tuple[int, int, torch.Tensor]],
                        lora: bool = False) -> None:
        """Before rank 0's forward pass: the same pass on every rank (see `StepMsg`; `lora`: with each
        request's adapter slot)."""
        self.check_ranks()
        entries = [(row, start, int(values.shape[0])) for row, start, values in journal]
        plan = batch.prompt_logprobs
        self._send(StepMsg(
            mode=batch.mode.value, input_ids=batch.input_ids, positions=batch.positions,
            prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens, req_pool_indices=batch.req_pool_indices,
            future_rows=batch.future_rows, logit_rows=plan.rows if plan is not None and plan.rows else None,
            num_slots=int(batch.out_cache_loc.shape[0]), journal=entries,
            lora_slots=[r.lora_slot for r in batch.reqs] if lora else None,
            dp_ranks=[r.dp_rank for r in batch.reqs] if self.tp.dp_attention else None))
        parts = [batch.out_cache_loc] + [values.to(self.device) for _, _, values in journal]
        payload = torch.cat(parts) if len(parts) > 1 else parts[0]
        if payload.numel():
            self._comm.broadcast(payload.to(torch.int64).contiguous())

    def lora_slot(self, slot: int, name: str, path: str | None) -> None:
        """Every other rank writes its shard of the adapter at `path` into `slot` (None: empties it)."""
        self.check_ranks()
        self._send(LoraSlotMsg(slot, name, path))

    def share_tokens(self, tokens: torch.Tensor) -> None:
        """After sampling: every rank gets the tokens (the next step's future inputs)."""
        self._send(TokensMsg(int(tokens.shape[0])))
        if tokens.shape[0]:
            self._comm.broadcast(tokens.to(torch.int64).contiguous())

    def kv_command(self, msg: KVGatherMsg | KVScatterMsg, slots: torch.Tensor) -> None:
        """Start a KV gather or scatter on every rank: the message, then the slots."""
        self.check_ranks()
        self._send(msg)
        self._comm.broadcast(slots.to(torch.int64).contiguous())

    @property
    def _comm(self) -> TorchCommunicator:
        assert self.comm is not None, "the tensor-parallel group is not joined yet"
        return self.comm

    def _send(self, msg: ToRankMsg) -> None:
        data = encoder.encode(msg)
        for sock in self._sends:
            sock.send(data, copy=False)

    # ---- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the other ranks (killed if they do not exit in time) and leave the group."""
        if self._closed:
            return
        self._closed = True
        for sock in self._sends:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(encoder.encode(StopMsg()), zmq.NOBLOCK)
        # Every rank leaves the group at once (each rank's Stop handler does too); a rank already gone: abort.
        _leave_group(abort=any(proc.poll() is not None for proc in self._procs))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank process %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
                _mark_group_unfinished()  # the group lost a member mid-teardown: its destructor would abort
        for sock in [*self._sends, self._status]:
            sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        atexit.unregister(self.close)
        _OPEN.discard(self)

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [proc.pid for proc in self._procs]


def _leave_group(abort: bool) -> None:
    """Leave the tensor-parallel group, waiting at most TEARDOWN_TIMEOUT_S: on two H200s (torch 2.11, NCCL 2.28)
    neither `destroy_process_group` nor an abort returned after a TP 2 run with CUDA graphs, and a worker's
    shutdown must not hang on it (the process then exits without it)."""
    thread = threading.Thread(target=TorchCommunicator.destroy, kwargs={"abort": abort}, daemon=True,
                              name="tp-leave-group")
    thread.start()
    thread.join(TEARDOWN_TIMEOUT_S)
    if thread.is_alive():
        _mark_group_unfinished()
        logger.error("leaving the tensor-parallel group did not finish within %.0f s; going on without it (the "
                     "process will exit without running the group's destructor)", TEARDOWN_TIMEOUT_S)


def close_open_leaders() -> None:
    """Close every group still open (a command that returned without closing its engine): before the CLI decides
    how to exit, not in `atexit`, where a teardown left running would abort the interpreter's finalization."""
    for lead in list(_OPEN):
        lead.close()


def _mark_group_unfinished() -> None:
    """The group was not left cleanly: the CLI exits without the destructors (`GROUP_LEFT_UNFINISHED`)."""
    global GROUP_LEFT_UNFINISHED
    GROUP_LEFT_UNFINISHED = True
