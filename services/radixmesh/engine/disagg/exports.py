"""Prefill side: compute a prompt (reusing this worker's radix cache), sample its first token, and
expose the KV of the requested suffix to a transport until the decode side has it.

The request runs as an ordinary one-token request. The export locks the prompt's path in the radix
tree (so nothing evicts it) and lets the transport gather the suffix's slots; the chunks go to the
front end ahead of the first token, once that token is emitted. `ReleaseTransferMsg` (or the lease)
unlocks it; the KV stays cached here.

When the export is staged matters on a GPU. Under the overlap scheduler a pass's outputs are read
back after the next pass was launched, so a gather queued then runs behind that whole next pass, and
so does anything the decode side queues behind it (cuda-ipc's copy waits on the gather's event on the
decode GPU's stream, stalling its decode steps). `stage_launched` therefore queues the gather of the
prompts finishing in the pass on the device *before* the scheduler launches the next one; their
chunks are still sent only with the first token, when the gather right behind that pass is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from radixmesh.common.errors import RadixMeshError
from radixmesh.engine.disagg.transport.choice import AUTO, ReceiverInfo, choose_transport, decode_receiver_info
from radixmesh.engine.request import Req
from radixmesh.wire.disagg import ExportCachedReqMsg, KVExportMsg, PrefillReqMsg
from radixmesh.wire.messages import TokenOut

if TYPE_CHECKING:
    from radixmesh.engine.disagg.transport.base import BaseKVTransport
    from radixmesh.engine.radix_cache import MatchResult, TreeNode
    from radixmesh.engine.scheduler.core import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class HeldTransfer:
    """A prompt's KV locked in the radix tree while a transport exposes it."""

    transfer_id: str
    rid: str
    node: TreeNode
    transport: str
    expires_at: float


class ExportManager:
    def __init__(self, scheduler: Scheduler, transport: Callable[[str], BaseKVTransport],
                 send: Callable[[KVExportMsg], object], clock: Callable[[], float] = time.monotonic,
                 local_info: Callable[[], ReceiverInfo] | None = None) -> None:
        self.sched = scheduler
        self.transport = transport
        self.send = send
        self.clock = clock
        self.local_info = local_info or (lambda: ReceiverInfo())
        """This side described as `choice` compares it with a receiver (auto)."""
        self._choices: set[tuple[str, str, str]] = set()
        """(receiver host, receiver GPU, transport) choices logged already."""
        self.requested: dict[str, PrefillReqMsg] = {}
        """rid -> prefill request still computing."""
        self.staged: dict[str, list[KVExportMsg] | str] = {}
        """rid -> chunks of a prompt still computing whose gather is queued (or why its export failed)."""
        self.held: dict[str, HeldTransfer] = {}
        self.by_transport: dict[str, int] = {}
        """Transfers sent, by the transport they went with."""
        self.counters = {"num_exports": 0, "kv_bytes_exported": 0, "num_transfers_lapsed": 0, "num_export_errors": 0,
                         "num_cached_exports": 0, "cached_tokens_exported": 0}

    def prefill(self, msg: PrefillReqMsg) -> None:
        """Queue the prompt as a one-token request; its KV from `start_pos` on is exported when done."""
        params = msgspec.structs.replace(msg.params, max_new_tokens=1, min_new_tokens=min(msg.params.min_new_tokens, 1),
                                         n=1, logprob_start_len=-1)
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), params=params)
        if not 0 <= msg.start_pos < len(msg.input_ids):
            self.sched.fail(req, f"start_pos {msg.start_pos} is outside the prompt of {len(msg.input_ids)} tokens")
            return
        try:
            msg = msgspec.structs.replace(msg, transport=self._choose(msg.transport, msg.transport_params))
        except RadixMeshError as exc:
            self.sched.fail(req, exc.message)
            return
        self.requested[msg.rid] = msg
        self.sched.add_request(req)

    def stage_launched(self) -> None:
        """Queue the export of the prompts whose last pass is on the device, before the next pass is launched
        (call between `Scheduler.step`s; see the module docstring). Without overlap nothing is in flight here."""
        launched = self.sched.in_flight
        if launched is None or not self.requested:
            return
        for row, req in enumerate(launched.batch.reqs):
            msg = self.requested.get(req.rid)
            if msg is not None and req.rid not in self.staged and (launched.launch_id, row) in req.futures:
                self.staged[req.rid] = self._stage(msg)

    def on_outputs(self, outputs: list[TokenOut]) -> list[TokenOut]:
        """Send the KV of prefill requests that just finished ahead of their outputs; returns the outputs to
        emit (a failed export turns its output into an error)."""
        if not self.requested:
            return outputs
        result = []
        for out in outputs:
            msg = self.requested.pop(out.rid, None) if out.finish_reason is not None else None
            result.append(out if msg is None else self._finish(msg, out))
        return result

    def _finish(self, msg: PrefillReqMsg, out: TokenOut) -> TokenOut:
        staged = self.staged.pop(msg.rid, None)
        if out.finish_reason in ("abort", "error"):
            self.release(msg.transfer_id)  # staged, never sent
            return out
        if staged is None:
            staged = self._stage(msg)
        elif isinstance(staged, list) and msg.transfer_id not in self.held:
            staged = "the exported KV's lease ran out before the prompt's first token"
        if isinstance(staged, str):
            self.counters["num_export_errors"] += 1
            return msgspec.structs.replace(out, finish_reason="error", error=staged)
        self._send(staged)
        self.counters["num_exports"] += 1
        return out

    def _stage(self, msg: PrefillReqMsg) -> list[KVExportMsg] | str:
        match = self.sched.kv.tree.match_prefix(list(msg.input_ids))
        if len(match.indices) < len(msg.input_ids):
            return ("the prompt's KV is not in the radix cache after prefill "
                    "(a prefill worker needs its radix cache on)")
        return self._stage_match(msg.rid, msg.transfer_id, match, msg.start_pos, msg.transport, msg.lease_s,
                                 msg.transport_params)

    def export_cached(self, msg: ExportCachedReqMsg) -> None:
        """Prefix sharing: send the KV this worker holds of positions start_pos.. of `input_ids`, computing
        nothing, then one TokenOut whose `cached_tokens` is where the sent KV ends (see ExportCachedReqMsg)."""
        match = self.sched.kv.tree.match_prefix(list(msg.input_ids))
        end, error, transport = len(match.indices), None, msg.transport
        try:
            transport = self._choose(msg.transport, msg.transport_params)
        except RadixMeshError as exc:
            error = exc.message
        if error is None and end > msg.start_pos:
            staged = self._stage_match(msg.rid, msg.transfer_id, match, msg.start_pos, transport, msg.lease_s,
                                       msg.transport_params)
            if isinstance(staged, str):
                error = staged
            else:
                self._send(staged)
                self.counters["num_cached_exports"] += 1
                self.counters["cached_tokens_exported"] += end - msg.start_pos
        self.sched.emit([TokenOut(msg.rid, [], len(msg.input_ids), end if error is None else 0, 0,
                                  finish_reason="error" if error else "length", error=error)])

    def _stage_match(self, rid: str, transfer_id: str, match: MatchResult, start_pos: int, transport: str,
                     lease_s: float, params: bytes = b"") -> list[KVExportMsg] | str:
        """Lock the matched path and export the KV of its positions start_pos..: the chunks to send, or an error."""
        self.sched.kv.tree.inc_lock_ref(match.last_node)
        self.held[transfer_id] = HeldTransfer(transfer_id, rid, match.last_node, transport, self.clock() + lease_s)
        try:
            chunks = self.transport(transport).export(transfer_id, match.indices[start_pos:],
                                                      decode_receiver_info(params))
        except (RadixMeshError, AssertionError, RuntimeError) as exc:
            self.release(transfer_id)
            logger.warning("request %s: KV export failed: %s", rid, exc)
            return f"KV export failed: {exc}"
        return [KVExportMsg(rid, transfer_id, index, len(chunks), msgspec.structs.replace(chunk, lease_s=lease_s))
                for index, chunk in enumerate(chunks)]

    def _choose(self, requested: str, params: bytes) -> str:
        """The transport of `transfer_id`: `requested`, or for auto the one `choice` picks for its receiver;
        RadixMeshError when it cannot run here."""
        receiver = decode_receiver_info(params)
        chosen, why = choose_transport(requested, receiver, self.local_info())
        self.transport(chosen)
        key = ("" if receiver is None else receiver.host_id,
               receiver.gpu_uuids[0] if receiver is not None and receiver.gpu_uuids else "", chosen)
        if requested == AUTO and key not in self._choices:
            self._choices.add(key)
            level = logging.WARNING if chosen == "grpc" else logging.INFO  # the slow path: say why, always
            logger.log(level, "KV transport auto: %s for receivers on %s (%s)", chosen, key[0] or "an unknown host",
                       why)
        return chosen

    def _send(self, msgs: list[KVExportMsg]) -> None:
        msgs = self._finalize(msgs)
        for msg in msgs:
            self.send(msg)
            self.counters["kv_bytes_exported"] += msg.chunk.num_bytes
            self.by_transport[msg.chunk.transport] = self.by_transport.get(msg.chunk.transport, 0) + (msg.index == 0)

    def _finalize(self, msgs: list[KVExportMsg]) -> list[KVExportMsg]:
        """The chunks as they leave: a transport may wait for its device work and make them final here."""
        final: list[KVExportMsg] = []
        for transfer_id in dict.fromkeys(m.transfer_id for m in msgs):
            mine = [m for m in msgs if m.transfer_id == transfer_id]
            held = self.held.get(transfer_id)
            chunks = self.transport(held.transport).ready_to_send(transfer_id) if held is not None else None
            if chunks is None:
                final += mine
                continue
            lease_s, rid = mine[0].chunk.lease_s, mine[0].rid
            final += [KVExportMsg(rid, transfer_id, index, len(chunks), msgspec.structs.replace(chunk, lease_s=lease_s))
                      for index, chunk in enumerate(chunks)]
        return final

    def release(self, transfer_id: str) -> None:
        held = self.held.pop(transfer_id, None)
        if held is None:
            return
        self.sched.kv.tree.dec_lock_ref(held.node)
        self.transport(held.transport).release(transfer_id)

    def abort(self, rid: str) -> None:
        self.requested.pop(rid, None)  # the scheduler aborts the request itself
        self.staged.pop(rid, None)
        for transfer_id in [t for t, h in self.held.items() if h.rid == rid]:
            self.release(transfer_id)

    def tick(self) -> None:
        now = self.clock()
        for transfer_id in [t for t, h in self.held.items() if h.expires_at < now]:
            logger.warning("transfer %s lapsed before the decode side confirmed it; releasing its KV", transfer_id)
            self.counters["num_transfers_lapsed"] += 1
            self.release(transfer_id)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "num_transfers_held": len(self.held), "num_prefills_running": len(self.requested)}
